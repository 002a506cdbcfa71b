"""Checkpoints written in the background (`async_checkpoint`): the step loop waits only
for a copy of the variables in host memory, a thread writes the files from that copy.

Not `tf.train.CheckpointOptions(enable_async=True)`, because with TF 2.21 and Keras 3.15
(run here) it cannot keep two guarantees:

- its second save of a model with Keras 3 variables fails ("tf.function only supports
  singleton tf.Variables created on the first call"): Keras's `_copy_trackable_to_cpu`
  makes a new tf.Variable on every call, and TF calls it inside its traced copy function;
- `CheckpointManager.sync()` waits for the write but never raises its error: a full disk
  surfaces only at the next save, or as a traceback from an atexit hook at exit.

What is TensorFlow's all the same: the copy is TF's own (each variable's
`_copy_trackable_to_cpu` into a CPU variable, and an object map the saver writes from,
as TF's async helper does; `engine.compat`), and the write is `CheckpointManager.save`
itself, called on the thread: the files in `ckpt-N_temp/`, moved into place, then the
state file (`checkpoint`, by atomic rename), then rotation. So the state file names a
checkpoint only once its files are complete, as with synchronous saves, and a kill -9
at any moment leaves the previous checkpoint the latest.

One write at a time: the next save waits for the one under way before it copies (the
copy must not change under the writer). The thread is not a daemon, so a process that
ends normally ends the write first; the Checkpointer's `wait` raises its error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from engine import compat
from engine.checkpointing import discovery
from engine.logger import logger

# Strategies whose saves stay synchronous: the background write was not verified there. (Under
# MultiWorkerMirroredStrategy a SIGTERM to one worker once ended with its peer failing on the lost
# heartbeat; that was a stop request read after the workers' agreement, fixed in
# Trainer._should_stop, not the background write, which was already off there when it recurred.)
SYNCHRONOUS_STRATEGIES = (
    tf.distribute.experimental.ParameterServerStrategy,
    tf.distribute.TPUStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
)


def writes_in_background(strategy: tf.distribute.Strategy, wanted: bool) -> bool:
    """Whether saves under `strategy` are asynchronous when `wanted` (`async_checkpoint`):
    not under multi-worker, parameter-server or TPU strategies (said once, in the log)."""
    if wanted and isinstance(strategy, SYNCHRONOUS_STRATEGIES):
        logger.info(
            "%s saves checkpoints synchronously (async_checkpoint is off there)", type(strategy).__name__
        )
        return False
    return wanted


class HostCopy:
    """A copy in host memory of every variable a checkpoint saves, taken on the caller's
    thread, and a twin of the checkpoint whose saves write the copy.

    The twin (a `tf.train.Checkpoint` of the same objects under the same names) writes
    the same files as the original and restores into the same objects; the original is
    left as it is, for hooks that save from it (the best checkpoint).
    """

    def __init__(self, checkpoint: tf.train.Checkpoint):
        children = tf.train.TrackableView(checkpoint).children(checkpoint)
        self.twin = tf.train.Checkpoint(
            **{name: obj for name, obj in children.items() if name != "save_counter"}
        )
        self._object_map = compat.identity_map()
        compat.save_from(self.twin, self._object_map)
        self._copied: list[Any] = []
        self._copy_all: Any = None  # The compiled copy of `_copied`.

    @contextlib.contextmanager
    def originals_saved(self) -> Iterator[None]:
        """Within: the twin's saves write the objects themselves, not their copies (a save
        waited for at once: copying first would only add time)."""
        compat.save_from(self.twin, None)
        try:
            yield
        finally:
            compat.save_from(self.twin, self._object_map)

    def unsupported(self) -> str | None:
        """Something the checkpoint saves that is not a variable (a lookup table, a custom
        trackable): no copy of it can be taken, so it must be saved synchronously."""
        for obj in self._saved():
            if not isinstance(obj, tf.Variable | keras.Variable):
                return f"{type(obj).__name__} {getattr(obj, 'name', '')}".strip()
        return None

    def take(self) -> None:
        """Copies every variable now; a variable made since the last copy is included."""
        saved = self._saved()
        if [id(v) for v in saved] != [id(v) for v in self._copied]:
            for variable in saved:  # Eagerly: makes the CPU variables.
                compat.copy_to_host(variable, self._object_map)
            self._copied = saved
            self._copy_all = tf.function(self._assign_all).get_concrete_function()
        # Run once more on the first save: a compiled function's first run is slow (its graph is
        # optimized then), and the first save pays for the copies' making anyway.
        self._copy_all()

    def _assign_all(self) -> None:
        for variable in self._copied:
            compat.copy_to_host(variable, self._object_map)

    def _saved(self) -> list[Any]:
        """What the twin's save writes values of: every object with state of its own but
        the save counter (the writer's, numbering saves, written as it is)."""
        counter = compat.save_counter(self.twin)
        return [
            obj
            for obj in tf.train.TrackableView(self.twin).descendants()
            if obj is not self.twin and obj is not counter and compat.has_own_state(obj)
        ]


class BackgroundWriter:
    """Runs `manager.save` for one step at a time on a thread of its own."""

    def __init__(self, manager: tf.train.CheckpointManager):
        self.manager = manager
        self._thread: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None

    def start(self, step: int) -> None:
        assert self._thread is None, "one write at a time: join() first"
        self._thread = threading.Thread(target=self._write, args=(step,), name=f"checkpoint-{step}")
        self._thread.start()

    def _write(self, step: int) -> None:
        try:
            # A failed write removes its own partial folder at once: the run may end before `result`.
            with discovery.partial_removed_on_error(os.path.join(self.manager.directory, f"ckpt-{step}")):
                path = self.manager.save(checkpoint_number=step)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread by `result`
            self._failed = (step, error)
            # A script that never waits again (no close()) still hears of it, at exit.
            atexit.register(self._report_unclaimed)
            return
        logger.info("Saved checkpoint %s", path)

    def _report_unclaimed(self) -> None:
        if self._failed is not None:
            step, error = self._failed
            logger.error(
                "the checkpoint of step %d was never written (%s: %s); the previous checkpoint is the latest",
                step,
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
            )

    def join(self) -> None:
        """Returns once no write is under way."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def result(self) -> tuple[int, BaseException] | None:
        """After `join`: the step and error of a write that failed since the last call, if any."""
        self.join()
        failed, self._failed = self._failed, None
        return failed
