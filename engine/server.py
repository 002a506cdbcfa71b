"""`python -m engine.server`: a worker or ps task of a parameter-server cluster (`engine.launch.task_server`)."""

import sys

from absl import app, flags

from engine.cli.config import cluster_flags
from engine.launch import task_server

flags.adopt_module_key_flags(cluster_flags)  # --help shows the cluster flags.
__doc__ = task_server.__doc__  # What --help prints above the flags.

if __name__ == "__main__":
    app.run(lambda argv: sys.exit(task_server.main(argv)))
