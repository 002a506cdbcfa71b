"""The CPU an engine command spends before its first step: the collector and numpy's threads.

Every `python -m engine.<module>` (a run, each task of a cluster, a server) imports
TensorFlow and Keras and traces its functions: about a million objects that live as long
as the process, built in its first seconds. Two defaults of the interpreter cost CPU there
that the run never gets back (figures: benchmarks/RESULTS.md, "Figures behind the code's
choices"):

- Python's cyclic collector runs every 700 net allocations, hundreds of times in that
  start-up. An engine command runs its first generation every
  `FIRST_GENERATION_THRESHOLD` allocations instead; what a compiled training loop
  allocates per call is small, so the threshold stays.
- numpy's OpenBLAS starts a thread per core at its import and they spin waiting for work.
  An engine command computes with TensorFlow; numpy only holds its data and figures. So
  numpy's BLAS gets one thread, unless the environment already says how many
  (`OPENBLAS_NUM_THREADS`, `OMP_NUM_THREADS`).

And at the end, the interpreter's finalization runs a last full collection, which would
traverse every one of those objects in a process that is ending. The last exit handler
freezes the collector (`gc.freeze`), so that collection skips them; the modules are still
torn down and every object still released by its reference count (open files closed,
buffers flushed), as without it. Only a finalizer of an object in a reference cycle that
nothing reaches would no longer run at exit. (`engine.main` ends before finalization,
after its exit handlers: `engine.cli.main_command.exit_process`; the servers and the
launcher go through it.)

Research code that imports `engine` keeps its interpreter's settings: only the commands
call this.
"""

from __future__ import annotations

import atexit
import gc
import os

FIRST_GENERATION_THRESHOLD = 20_000  # Python's default: 700. The older generations keep theirs.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def tune_for_start_up() -> None:
    """At an engine command's first line, before numpy is imported (and before any other
    exit handler is registered: the one registered here runs last)."""
    if not any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(FIRST_GENERATION_THRESHOLD, older, oldest)
    atexit.register(skip_the_final_collection)


def skip_the_final_collection() -> None:
    """The last exit handler: the objects alive now are not traversed again at finalization."""
    gc.freeze()
