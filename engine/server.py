"""`python -m engine.server`: a worker or ps task of a parameter-server cluster (see `engine.cluster.server`)."""

import sys

from absl import app, flags

from engine.cluster import flags as cluster_flags
from engine.cluster import server

flags.adopt_module_key_flags(cluster_flags)  # --help shows the cluster flags.
__doc__ = server.__doc__  # What --help prints above the flags.

if __name__ == "__main__":
    app.run(lambda argv: sys.exit(server.main(argv)))
