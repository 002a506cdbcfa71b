"""`python -m engine.launch`: a whole cluster on this machine (see `engine.launch.launcher`)."""

import sys

from absl import app, flags

from engine.launch import launcher

flags.adopt_module_key_flags(launcher)  # --help shows the launcher's flags.
__doc__ = launcher.__doc__  # What --help prints above the flags.

if __name__ == "__main__":
    app.run(lambda argv: sys.exit(launcher.main(argv)), flags_parser=launcher.parse_flags)
