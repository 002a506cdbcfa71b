"""The hook API around the compiled loop: `Callback` and the `TrainerView` it receives.

Hooks run on the host between compiled calls, never inside the step: adding
them costs no retrace and no per-step work. A hook is either a `Callback`
(override any of its methods), a plain callable, which is called after
every loop as `fn(trainer, step, logs)`, or a `keras.callbacks.Callback`,
which `engine.callbacks.keras_adapter` calls at epoch ends as `fit` would.

To stop training, a hook sets `trainer.stop_training = True`; the trainer
finishes the current loop, saves a checkpoint and returns. The stop stays in
force for later `train()` calls until `trainer.clear_stop()`.

A hook that needs to see a particular step (a profiler window, a log line
every N steps) returns from `loop_limit` the most steps the next compiled
loop may run; the loop is cut there, its trace is reused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import contextlib

    import keras
    import tensorflow as tf

    from engine.summaries import SummaryWriters

Logs = Mapping[str, Any]


class TrainerView(Protocol):
    """What a hook may use of the trainer that calls it, and nothing else.

    `engine.Trainer` is one; so is the view `engine.cli.run.evaluator` gives
    `BestCheckpoint`. Anything else on the trainer is internal and may change.
    """

    model: Any  # The keras.Model (or tf.Module) being trained.
    optimizer: keras.optimizers.Optimizer | None  # The optimizer; None when there are several.
    strategy: tf.distribute.Strategy
    target_step: int | None  # The step the current `train()` call trains to (None before one).
    stop_training: bool  # Set it to True to stop after this loop, with a checkpoint.

    # Read-only to a hook (properties, so that a trainer's dict or an evaluator's str satisfies them).
    @property
    def optimizers(self) -> Mapping[str, keras.optimizers.Optimizer]:
        """Every optimizer by name."""

    @property
    def model_dir(self) -> str | None:
        """Where this task writes; None: nothing is written."""

    @property
    def step(self) -> int:
        """The global step (updates applied)."""

    @property
    def summaries(self) -> SummaryWriters:
        """TensorBoard writers by run name (`.writer("train")`); they write nothing without model_dir."""

    @property
    def checkpoint(self) -> tf.train.Checkpoint | None:
        """What the trainer's checkpoints hold (model, step, optimizers), for a hook that saves
        one of its own (`BestCheckpoint`); None without model_dir."""

    def evaluates_after(self, step: int) -> bool:
        """Whether the loop that ends at `step` is followed by an evaluation."""

    def averaged_weights(self) -> contextlib.AbstractContextManager[None]:
        """While inside, the model holds the moving averages of its weights (--ema_decay; the
        weights unchanged without EMA), as evaluation sees them; the training weights come back after."""


class Callback:
    """Base class with no-op hooks; override the ones you need.

    Every method receives the trainer as a `TrainerView` (read `trainer.step`,
    `trainer.model`, set `trainer.stop_training`) and returns nothing unless said otherwise.
    An exception raised in a hook ends `train()` with it.
    """

    # True for a hook that sets the learning rate itself (reduce on plateau):
    # the trainer then keeps a restored checkpoint's rate instead of resetting it.
    owns_learning_rate: bool = False
    # True for a hook that reads `grad_norm` from the loop's logs (the standard step then
    # computes it: with several replicas and no clip_norm, one more all-reduce a step).
    needs_grad_norm: bool = False

    def check_trainer(self, trainer: TrainerView) -> None:
        """Once, when the trainer is built, before anything is written: raise a `UserError`
        naming the hook where it cannot work with this trainer (e.g. one that sets the
        learning rate, given a dict of optimizers), rather than fail mid-training."""

    def restore_state(self, trainer: TrainerView) -> None:
        """Once, at the end of the trainer's construction (its checkpoint restored, nothing
        written yet): read and check the hook's own state on disk, raising a `UserError`
        where it cannot be trusted. Hooks that call it again themselves keep it idempotent."""

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        """Before each loop: how far it may run, so the hook sees the step it needs.

        Args:
          trainer: the trainer.
          step: the global step the loop starts at.

        Returns:
          The most steps the compiled loop starting at `step` may run (None: any).
        """
        return None

    def on_train_begin(self, trainer: TrainerView) -> None:
        """When `train()` starts (after a restore: `trainer.step` is the restored step)."""

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Logs) -> None:
        """After each compiled loop.

        Args:
          trainer: the trainer.
          step: the global step reached.
          logs: that loop's means (loss, metrics), speed and learning rate(s).
        """

    def on_eval_end(self, trainer: TrainerView, step: int, logs: Logs) -> None:
        """After each evaluation.

        Args:
          trainer: the trainer.
          step: the global step evaluated.
          logs: eval loss, metrics and `num_examples` over the whole eval set.
        """

    def on_train_end(self, trainer: TrainerView, logs: Logs) -> None:
        """When `train()` returns (or ends because the data ran out), with the last loop's logs."""


LoopFn = Callable[[TrainerView, int, Logs], None]
CallbackLike = Callback | LoopFn


class LoopFunction(Callback):
    """A plain `fn(trainer, step, logs)` hook, called after every loop."""

    def __init__(self, fn: LoopFn):
        self._fn = fn

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Logs) -> None:
        self._fn(trainer, step, logs)
