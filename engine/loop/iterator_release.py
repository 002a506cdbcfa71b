"""Iterators the loop is done with are freed on threads of their own, not on the loop's.

Freeing a tf.data iterator that was read to its end can block the freeing thread for
seconds, up to a minute, with every thread asleep (TensorFlow 2.21: the MultiDeviceIterator
a MirroredStrategy evaluation reads; its host iterator waits for its tf.data autotuning
thread to end), time goodput would book as evaluation; now and then the wait never ends
(figures and the incident: benchmarks/RESULTS.md, "Figures behind the code's choices").
The wait holds nothing Python needs, so an `EvalRunner` and a `PredictRunner` hand each
finished iterator here (a `TrainRunner` the one it replaces, is closed with or is dropped
with: a Trainer let go without close()), and a daemon thread of its own drops it while
training goes on: one destructor that never returns holds that thread and no other
iterator.

At the process's exit the interpreter waits for those threads (an exit handler), at most
`EXIT_WAIT_S`: Python ends a daemon thread still inside TensorFlow at finalization by
unwinding it, which can abort the process, and a finished run must not wait forever
either. What is still held then is named in one warning line. `engine.main`, which ends
without the interpreter's finalization, does not wait at all.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

from engine.logger import logger

# Until the loop's thread has let go of the iterator: the destructor must run on the release thread.
_HANDOVER_WAIT_S = 1.0
# The longest a process's exit waits for the iterators still being freed.
EXIT_WAIT_S = 60.0
_THREAD_NAME = "engine-iterator-release"
_pending: set[threading.Thread] = set()
_lock = threading.Lock()


def release_in_background(holder: list[Any]) -> None:
    """Takes the only reference to an iterator, `holder`'s one item, and frees it on a
    release thread (a list, so that no frame of the caller still holds the iterator)."""
    thread = threading.Thread(target=_free, args=([holder.pop()],), name=_THREAD_NAME, daemon=True)
    with _lock:
        _pending.add(thread)
    thread.start()


def wait_until_all_freed(timeout_s: float | None = None) -> bool:
    """Waits at most `timeout_s` (`EXIT_WAIT_S`) for every iterator handed over to be freed;
    False (and one warning line) where some destructor has not returned by then."""
    timeout_s = EXIT_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    with _lock:
        threads = list(_pending)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        held = len(_pending)
    if held:
        logger.warning(
            "%d input iterator(s) still being freed after %g s (TensorFlow's tf.data destructor "
            "waiting on its autotuning thread): not waiting for them",
            held,
            timeout_s,
        )
    return held == 0


def do_not_wait_at_exit() -> None:
    """For a process that ends without the interpreter's finalization (`os._exit`), where a
    release thread still inside TensorFlow is harmless: its exit waits for none."""
    atexit.unregister(wait_until_all_freed)


atexit.register(wait_until_all_freed)  # Returns at once where nothing is being freed.


def _free(holder: list[Any]) -> None:
    item = holder.pop()
    deadline = time.monotonic() + _HANDOVER_WAIT_S
    # 2: this name and getrefcount's argument; more while the caller's frame still ends.
    while sys.getrefcount(item) > 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    del item  # The last reference, usually: TensorFlow's destructor runs (and waits) here.
    with _lock:
        _pending.discard(threading.current_thread())
