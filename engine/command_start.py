"""The CPU an engine command spends before its first step: the collector and numpy's threads.

Every `python -m engine.<module>` (a run, each task of a cluster, a server) imports
TensorFlow and Keras and traces its functions: about a million objects that live as long
as the process, built in its first seconds. Two defaults of the interpreter cost CPU there
that the run never gets back (measured on the quick start, 2 CPU cores):

- Python's cyclic collector runs every 700 net allocations: some 900 times in that
  start-up, 0.4 s of CPU. An engine command runs its first generation every
  `FIRST_GENERATION_THRESHOLD` allocations instead (30 collections, 0.16 s); what a
  compiled training loop allocates per call is small, so the threshold stays.
- numpy's OpenBLAS starts a thread per core at its import and they spin waiting for work
  (0.4 s of CPU during TensorFlow's import). An engine command computes with TensorFlow;
  numpy only holds its data and figures. So numpy's BLAS gets one thread, unless the
  environment already says how many (`OPENBLAS_NUM_THREADS`, `OMP_NUM_THREADS`).

Together about 5-8 % of a short run's CPU, in every process of a cluster. Research code
that imports `engine` keeps its interpreter's settings: only the commands call this.
"""

from __future__ import annotations

import gc
import os

FIRST_GENERATION_THRESHOLD = 20_000  # Python's default: 700. The older generations keep theirs.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def tune_for_start_up() -> None:
    """At an engine command's first line, before numpy is imported."""
    if not any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(FIRST_GENERATION_THRESHOLD, older, oldest)
