"""`python -m engine.launch`: a whole cluster on this machine (see `engine.cluster.launch`)."""

import sys

from absl import app, flags

from engine.cluster import launch

flags.adopt_module_key_flags(launch)  # --help shows the launcher's flags.
__doc__ = launch.__doc__  # What --help prints above the flags.

if __name__ == "__main__":
    app.run(lambda argv: sys.exit(launch.main(argv)), flags_parser=launch.parse_flags)
