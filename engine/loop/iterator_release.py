"""Iterators the loop is done with are freed on threads of their own, not on the loop's.

Freeing a tf.data iterator that was read to its end can block the freeing thread for
seconds, up to a minute, with every thread asleep (TensorFlow 2.21: the MultiDeviceIterator
a MirroredStrategy evaluation reads; its host iterator waits for its tf.data autotuning
thread to end), time goodput would book as evaluation; now and then the wait never ends
(figures and the incident: benchmarks/RESULTS.md, "Figures behind the code's choices").
The wait holds nothing Python needs, so an `EvalRunner` and a `PredictRunner` hand each
finished iterator here (a `TrainRunner` the one it replaces, the one of a call that raised,
the one it is closed with or is dropped with: a Trainer let go without close()), and a
daemon thread of its own drops it while training goes on: one destructor that never
returns holds that thread and no other iterator.

The thread keeps its reference until it holds the only one, however long that takes, so
that the destructor runs there and nowhere else. A compiled call that raised leaves the
iterator in its traceback's frames (the loop's, TensorFlow's), and under MirroredStrategy
that traceback is in a reference cycle (TensorFlow's coordinator of the replica threads
keeps the exception): only the garbage collector frees it, on whichever thread allocates
when it runs, a replica thread in the middle of tracing the next call, say. A thread that
let go after a fixed wait left the destructor to the collector there: a test stalled 24 s.

At the process's exit the interpreter waits for those threads (an exit handler), at most
`EXIT_WAIT_S`: Python ends a daemon thread still inside TensorFlow at finalization by
unwinding it, which can abort the process, and a finished run must not wait forever
either. What is still held then is named in one warning line. An iterator not yet being
freed at the exit (one a Trainer never closed still holds, one a traceback kept to the end
holds) is never freed (`leave_unfreed`): the interpreter's finalization would free it on
its one thread, waiting for that autotuning thread again, iterator after iterator, and the
process is ending: the system takes its memory back. `engine.main`, which ends without the
interpreter's finalization, does not wait at all.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import time
from typing import Any

from engine.logger import logger

# What the caller's frame takes to let go of an iterator it handed over (it ends at once): the
# exit waits that long for a thread still waiting for the others to let go, then leaves it.
_HANDOVER_WAIT_S = 1.0
# Between two looks at whether a thread holds the only reference: the first, doubled up to the last.
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.005, 0.25
# The longest a process's exit waits for the iterators still being freed.
EXIT_WAIT_S = 60.0
_THREAD_NAME = "engine-iterator-release"
_lock = threading.Lock()
_waiting: set[threading.Thread] = set()  # Handed an iterator that something else still holds.
_freeing: set[threading.Thread] = set()  # Dropping the only reference: TensorFlow's destructor runs.
_exiting = False  # Set by the exit handler: a thread left waiting frees nothing after it.


def release_in_background(holder: list[Any]) -> None:
    """Takes the only reference to an iterator, `holder`'s one item, and frees it on a
    release thread (a list, so that no frame of the caller still holds the iterator)."""
    thread = threading.Thread(target=_free, args=([holder.pop()],), name=_THREAD_NAME, daemon=True)
    with _lock:
        _waiting.add(thread)
    thread.start()


def leave_unfreed(holder: list[Any]) -> None:
    """Takes the only reference to an iterator, `holder`'s one item, at the process's exit, and
    never frees it: one more reference, which the interpreter's finalization does not drop."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(holder.pop()))


def wait_until_all_freed(timeout_s: float | None = None) -> bool:
    """Waits at most `timeout_s` (`EXIT_WAIT_S`) for every iterator handed over to be freed;
    False (and one warning line) where some destructor has not returned by then. One that
    something else still holds after `_HANDOVER_WAIT_S` is not this module's to wait for."""
    return _wait(EXIT_WAIT_S if timeout_s is None else timeout_s, exiting=False)


def do_not_wait_at_exit() -> None:
    """For a process that ends without the interpreter's finalization (`os._exit`), where a
    release thread still inside TensorFlow is harmless: its exit waits for none."""
    atexit.unregister(_wait_at_exit)


def _wait_at_exit() -> None:
    """The exit handler: what is handed over a moment before the exit is freed (waited for at
    most `EXIT_WAIT_S`); a thread still waiting after that frees nothing more."""
    _wait(EXIT_WAIT_S, exiting=True)


def _wait(timeout_s: float, *, exiting: bool) -> bool:
    global _exiting
    deadline = time.monotonic() + timeout_s
    _wait_for_handovers(min(deadline, time.monotonic() + _HANDOVER_WAIT_S))
    if exiting:
        with _lock:
            _exiting = True
    return _wait_for_destructors(deadline, timeout_s)


atexit.register(_wait_at_exit)  # Returns at once where nothing is being freed.


def _wait_for_handovers(until: float) -> None:
    while time.monotonic() < until:
        with _lock:
            if not _waiting:
                return
        time.sleep(_FIRST_PAUSE_S)


def _wait_for_destructors(deadline: float, timeout_s: float) -> bool:
    while True:
        with _lock:
            threads = list(_freeing)
        if not threads or time.monotonic() >= deadline:
            break
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        held = len(_freeing)
    if held:
        logger.warning(
            "%d input iterator(s) still being freed after %g s (TensorFlow's tf.data destructor "
            "waiting on its autotuning thread): not waiting for them",
            held,
            timeout_s,
        )
    return held == 0


def _free(holder: list[Any]) -> None:
    item = holder.pop()
    thread = threading.current_thread()
    pause = _FIRST_PAUSE_S
    while True:
        with _lock:
            # 2: this name and getrefcount's argument; more while the caller's frame still ends,
            # or while a traceback (a call that raised) still holds it.
            sole = sys.getrefcount(item) <= 2
            if _exiting or sole:
                _waiting.discard(thread)
                if _exiting:
                    leave_unfreed([item])
                    return
                _freeing.add(thread)
                break
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE_S)
    try:
        del item  # The last reference: TensorFlow's destructor runs (and waits) here.
    finally:
        with _lock:
            _freeing.discard(thread)
