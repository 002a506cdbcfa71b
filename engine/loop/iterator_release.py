"""Iterators the loop is done with are freed on a thread of their own, not on the loop's.

Freeing a tf.data iterator that was read to its end can block the freeing thread for
seconds, up to a minute, with every thread asleep (TensorFlow 2.21: the MultiDeviceIterator
a MirroredStrategy evaluation reads; its host iterator waits for one of its tf.data threads
to end). Measured on a 14 s evaluation: 2-57 s more in the loop's thread, which goodput books
as evaluation. The wait holds nothing Python needs, so an `EvalRunner` and a `PredictRunner`
hand each finished iterator here (a `TrainRunner` the one it replaces, is closed with or is
dropped with: a Trainer let go without close()), and one daemon thread drops it while training
goes on. At the process's exit the interpreter waits for that thread to be done (an exit
handler): Python ends a daemon thread still inside TensorFlow at finalization by unwinding it,
which aborts the process.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
from typing import Any

# Until the loop's thread has let go of the iterator: the destructor must run on this thread.
_HANDOVER_WAIT_S = 1.0
_released: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_starting = threading.Lock()


def release_in_background(holder: list[Any]) -> None:
    """Takes the only reference to an iterator, `holder`'s one item, and frees it on the
    release thread (a list, so that no frame of the caller still holds the iterator)."""
    global _thread
    with _starting:
        if _thread is None or not _thread.is_alive():
            if _thread is None:
                atexit.register(wait_until_all_freed)
            _thread = threading.Thread(target=_free_each, name="engine-iterator-release", daemon=True)
            _thread.start()
    _released.put(holder.pop())


def wait_until_all_freed() -> None:
    """At exit: the thread frees what it was given, then ends (None: the last item)."""
    if _thread is not None and _thread.is_alive():
        _released.put(None)
        _thread.join()


def _free_each() -> None:
    while True:
        item = _released.get()
        if item is None:
            return
        deadline = time.monotonic() + _HANDOVER_WAIT_S
        # 2: this name and getrefcount's argument; more while the caller's frame still ends.
        while sys.getrefcount(item) > 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        del item  # The last reference, usually: TensorFlow's destructor runs (and waits) here.
