"""`python -m engine.main`: train, evaluate or export from flags (the program: `engine.cli.main_command`).

Kept as small as this because two things must happen in the `__main__`
module itself: the signal watcher starts before TensorFlow starts its
threads, and `--help` lists the flags of the modules this one adopts.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ warnings; the start-up lines: engine.native_logs.

from engine.cli.process.preemption import install_watcher  # noqa: E402

if __name__ == "__main__":
    install_watcher()  # Before TensorFlow starts threads: they must all block SIGTERM/SIGINT.

from absl import flags  # noqa: E402

from engine.cli import main_command  # noqa: E402  (defines the flags)

# --help lists the flags of the __main__ module's key modules: every module of the engine that defines some
# (engine.cli.config.flags, the cluster's); --helpfull adds TensorFlow's and absl's.
for _module in [sys.modules[name] for name in flags.FLAGS.flags_by_module_dict() if name.startswith("engine.")]:
    flags.adopt_module_key_flags(_module)

if __name__ == "__main__":
    main_command.run_cli()
