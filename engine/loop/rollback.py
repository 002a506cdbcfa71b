"""Surviving loss spikes: `on_nonfinite="rollback"` restores the last good state and
skips the batches that led to the spike.

PaLM's authors restarted about 100 steps before a spike and skipped the
200-500 batches around it; a bad update cannot be undone, but the data that
caused it can be left out. A step is a spike when its loss or gradient is
not finite, or its loss is above `max_loss` (`engine.options.SpikeOptions`).
The loop reports the first spike of each compiled call (`engine.loop.compiled`), and
between calls the Trainer hands it to `Rollback.recover`, which:

1. restores the last good state: the newest checkpoint this Trainer's
   `Checkpointer` holds, or, where none is newer than the start of this
   `train()` call, the copy of the state taken there (in memory: weights,
   optimizer state, step, data position). Checkpoints are only written
   between compiled calls and the spike is found at the end of the call that
   ran it, so everything saved was saved before the spike: rotation
   (`max_checkpoints`) can never have deleted the state restored;
2. skips the batches that led to the spike: with the state restored at step
   r, the spike at step s (the s-th update) and offset o in force, the run
   had read stream positions r+o .. s-1+o for steps r+1 .. s; the offset
   becomes o + (s - r) + `rollback_skip_batches`, so step r+1 now reads
   position s+o+N: the batch after the spiking one, plus N more skipped;
3. counts it (`DataPosition.rollbacks`), logs a warning naming the step, the
   loss and the batches skipped, and writes the count to TensorBoard.

The offset and the count are part of every checkpoint (`DataPosition`), so a
run resumed after a rollback reads the same batches; one resumed from a
checkpoint taken before it repeats it (same data, same spike). After
`max_rollbacks` rollbacks the next spike stops the run, saving nothing.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import NamedTuple

import tensorflow as tf

from engine.checkpointing.checkpointer import Checkpointer, restore_latest
from engine.data import DataPosition
from engine.errors import UserError
from engine.logger import logger
from engine.options import SpikeOptions
from engine.summaries import SummaryWriters

# Where the data position lives in a checkpoint (`tf.train.Checkpoint(data_position=...)`).
CHECKPOINT_KEY = "data_position"
_OFFSET_TENSOR = f"{CHECKPOINT_KEY}/offset/.ATTRIBUTES/VARIABLE_VALUE"
_snapshots = itertools.count()


class Spike(NamedTuple):
    """The first spiking step of a compiled call: the global step its update made, and its loss."""

    step: int
    loss: float  # NaN where the step returned no "loss".


def check_options(strategy: tf.distribute.Strategy, on_nonfinite: str, options: SpikeOptions) -> None:
    """Refuses spike options that cannot work, in one line naming the argument."""
    problem = options.problem(on_nonfinite)
    if problem is not None:
        raise UserError(problem)
    if on_nonfinite == "rollback" and isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise UserError(
            "`on_nonfinite='rollback'` is not supported with ParameterServerStrategy: its workers update "
            "asynchronously in an order no rerun repeats, so skipping batches would not be exact; "
            "pass `on_nonfinite='stop'` (with `max_loss`) and restart from the last checkpoint"
        )


def holds_position(path: str | None) -> bool:
    """Whether the checkpoint at `path` holds a `DataPosition` (a run with rollback wrote it)."""
    if path is None:
        return False
    try:
        # Not tf.train.load_checkpoint: on ram:// it takes the prefix for a directory.
        return bool(tf.compat.v1.train.NewCheckpointReader(path).has_tensor(_OFFSET_TENSOR))
    except (tf.errors.OpError, ValueError):
        return False  # Unreadable: the restore names the problem.


def describe(spike: Spike, max_loss: float | None) -> str:
    """What a spike was: "non-finite loss at step 7", "loss 1.2e+12 above `max_loss=1000.0` at step 7"."""
    if max_loss is not None and math.isfinite(spike.loss) and spike.loss > max_loss:
        return f"loss {spike.loss:.4g} above `max_loss={max_loss}` at step {spike.step}"
    if math.isfinite(spike.loss):
        return f"non-finite gradient at step {spike.step} (loss {spike.loss:.4g})"
    return f"non-finite loss at step {spike.step}"


def stop_message(spike: Spike, options: SpikeOptions, latest: str | None, *, rolled_back: bool) -> str:
    """The one line a run stopped by a spike ends with: what, where, what is kept, what to do."""
    kept = f"stopped without saving, the latest checkpoint ({latest or 'none'}) is kept"
    if rolled_back:
        return (
            f"`max_rollbacks={options.max_rollbacks}` reached: {describe(spike, options.max_loss)} after "
            f"{options.max_rollbacks} rollback(s); {kept}; lower the optimizer's `learning_rate`, set "
            "`clip_norm`, or raise `max_rollbacks`"
        )
    remedy = (
        "pass `on_nonfinite='rollback'` to restore the last good checkpoint and skip the batches"
        if options.max_loss is not None
        else "pass `on_nonfinite='skip'` to skip such steps"
    )
    return (
        f"{describe(spike, options.max_loss)}; {kept}; lower the optimizer's `learning_rate`, "
        f"set `clip_norm`, or {remedy}"
    )


class Rollback:
    """Restores the last good state after a spike and moves the data past it (see the module).

    Args:
      checkpoint: what a checkpoint holds (model, global step, optimizers, `position`).
      global_step: the step counter `checkpoint` restores.
      position: the data position, checkpointed in `checkpoint` under `CHECKPOINT_KEY`.
      checkpointer: the run's checkpoints (None without a model_dir: only the start copy).
      options: `rollback_skip_batches`, `max_rollbacks`, `max_loss`.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        *,
        global_step: tf.Variable,
        position: DataPosition,
        checkpointer: Checkpointer | None,
        options: SpikeOptions,
    ):
        self.checkpoint = checkpoint
        self.global_step = global_step
        self.position = position
        self.checkpointer = checkpointer
        self.options = options
        # TensorFlow's in-memory file system: save and restore work there (see the shared notes).
        self._start_path = f"ram://engine-rollback/{next(_snapshots)}/start"
        self._start_step = -1  # The step of the start copy; -1: none taken yet.

    @property
    def exhausted(self) -> bool:
        """Whether `max_rollbacks` rollbacks were done: the next spike stops the run."""
        return int(self.position.rollbacks.numpy()) >= self.options.max_rollbacks

    def keep_start(self) -> None:
        """Copies the state at the start of a train() call (in memory), so that a spike before
        the first checkpoint restores it: the initial weights and optimizer state, or those
        restored from (or reset since) the checkpoint the run resumed from."""
        _ = self.checkpoint.save_counter  # Made now, or a later read would find it unmatched.
        self.checkpoint.write(self._start_path)
        self._start_step = self._step

    def discard_start(self) -> None:
        """Frees the in-memory copy (`Trainer.close()`); the next train() call takes a new one."""
        directory = self._start_path.rsplit("/", 1)[0]
        if tf.io.gfile.exists(directory):
            tf.io.gfile.rmtree(directory)
        self._start_step = -1

    @property
    def _step(self) -> int:
        return int(self.global_step.numpy())

    def recover(self, spike: Spike, summaries: SummaryWriters) -> None:
        """Restores the last good state and skips the batches up to and including the spike's,
        plus `rollback_skip_batches` more; logs and counts the rollback."""
        offset = int(self.position.offset.numpy())
        count = int(self.position.rollbacks.numpy()) + 1
        restored = self._restore_last_good()
        skipped = spike.step - self._step + self.options.rollback_skip_batches
        first = self._step + offset  # The stream positions left out: [first, first + skipped).
        self.position.offset.assign(offset + skipped)
        self.position.rollbacks.assign(count)
        logger.warning(
            "loss spike: %s; rolled back to %s (step %d), skipping %d batch(es) (stream positions %d-%d); "
            "rollback %d of at most %d",
            describe(spike, self.options.max_loss),
            restored,
            self._step,
            skipped,
            first,
            first + skipped - 1,
            count,
            self.options.max_rollbacks,
        )
        summaries.write("train", spike.step, {"rollbacks": float(count)})

    def _restore_last_good(self) -> str:
        """Restores the newest good state; says which (a checkpoint's path, or the start copy)."""
        latest = self.checkpointer.latest if self.checkpointer is not None else None
        if latest is not None and _step_of(latest) > self._start_step:
            assert self.checkpointer is not None
            path = restore_latest(self.checkpointer.manager)  # Weights, optimizer state, step, position.
            assert path is not None, "checked: a latest checkpoint"
            return path
        assert self._start_step >= 0, "keep_start() runs at the start of every train() call"
        self.checkpoint.read(self._start_path).assert_consumed()
        return "the state at the start of training"


def _step_of(path: str) -> int:
    """The step of `<model_dir>/checkpoints/ckpt-<step>` (the Checkpointer numbers them so)."""
    match = re.search(r"-(\d+)$", path)
    return int(match.group(1)) if match else -1
