"""The choices and defaults the library itself accepts, in one TF-free module.

The library (`Trainer`, strategies, schedules, hooks) and the command line
(`engine.cli.config.settings`, which builds its flags from them) share these names, so
they live below both: the library never imports the command line, and
`--help` lists them without importing TensorFlow. The option groups the
Trainer takes apart (`StepOptions`, `CheckpointOptions`, `Cadence`) are
frozen dataclasses: one definition of each group and its defaults.
"""

import dataclasses
from typing import TypedDict

SINGLE_HOST_STRATEGIES = ("default", "one_device", "mirrored")
MULTI_HOST_STRATEGIES = ("multi_worker_mirrored", "parameter_server", "tpu")
STRATEGY_NAMES = SINGLE_HOST_STRATEGIES + MULTI_HOST_STRATEGIES
# Precision name -> Keras dtype policy.
PRECISION_POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
SCHEDULE_NAMES = ("constant", "cosine", "step", "warmup_cosine")
# A NaN/Inf (or above `max_loss`) loss: stop, skip the update, or restore the last good
# checkpoint and skip the batches that led to it (engine.loop.rollback).
NONFINITE_POLICIES = ("stop", "skip", "rollback")
DEFAULT_MAX_ROLLBACKS = 3
# Each rollback restores a checkpoint and trains again from it: a run whose loss spikes at every step
# with a huge max_rollbacks would never end. A run that needs more than this has a problem to fix.
MAX_ROLLBACKS = 100
METRIC_MODES = ("auto", "min", "max")  # Whether a watched metric should go down or up.
COMMUNICATIONS = ("auto", "ring", "nccl")  # multi_worker_mirrored's collectives.
# Steps per compiled call: the Trainer's default and the CLI's (--steps_per_loop).
DEFAULT_STEPS_PER_LOOP = 50
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
DEFAULT_STARTUP_TIMEOUT = 300.0
# Seconds without a heartbeat after which a multi_worker_mirrored task counts as lost
# (TF's coordination service; its own default is 10): a frozen peer ends the run this fast.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


class StepArguments(TypedDict):
    """`StepOptions` as `engine.loop.steps.make_train_step` takes them."""

    clip_norm: float | None
    grad_accum_steps: int
    jit_compile: bool
    skip_nonfinite: bool


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the standard step turns a batch into an update. A `step_fn` replaces that
    step, so the Trainer refuses any of these that differs from its default."""

    clip_norm: float | None = None  # Clip the global gradient norm to this.
    grad_accum_steps: int = 1  # Micro-batches per update.
    jit_compile: bool = False  # XLA-compile the replica step.
    # A NaN/Inf loss or gradient: "stop" the run, "skip" the update, or "rollback" (engine.loop.rollback).
    on_nonfinite: str = "stop"

    def step_arguments(self) -> StepArguments:
        return StepArguments(
            clip_norm=self.clip_norm,
            grad_accum_steps=self.grad_accum_steps,
            jit_compile=self.jit_compile,
            skip_nonfinite=self.on_nonfinite == "skip",
        )

    def changed(self) -> list[str]:
        """`name=value` of each option that is not its default and shapes the step: "rollback"
        acts between loops (like "stop"), so a `step_fn` may have it."""
        default = StepOptions()
        return [
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(default, field.name)
            and (field.name, getattr(self, field.name)) != ("on_nonfinite", "rollback")
        ]


@dataclasses.dataclass(frozen=True)
class SpikeOptions:
    """What counts as a loss spike besides a NaN/Inf, and how `on_nonfinite="rollback"` recovers.

    A step is a spike when its loss or gradient is not finite, or its loss (the step's
    "loss" output, averaged over replicas) is above `max_loss`. `rollback_skip_batches`
    more batches than those since the restored checkpoint are skipped (engine.loop.rollback);
    after `max_rollbacks` rollbacks the next spike stops the run.
    """

    max_loss: float | None = None
    rollback_skip_batches: int = 0
    max_rollbacks: int = DEFAULT_MAX_ROLLBACKS

    def problem(self, on_nonfinite: str) -> str | None:
        """What is wrong with these options under `on_nonfinite`, in the library's terms; None: fine."""
        if self.max_loss is not None and not (self.max_loss > 0 and self.max_loss < float("inf")):
            return f"`max_loss={self.max_loss}` must be a positive, finite loss"
        if self.max_loss is not None and on_nonfinite == "skip":
            return (
                f"`max_loss={self.max_loss}` stops or rolls back on a spike; it cannot skip the update "
                "(the step has applied it when the loop sees the loss): pass `on_nonfinite='stop'` or "
                "`on_nonfinite='rollback'`"
            )
        if self.rollback_skip_batches < 0:
            return f"`rollback_skip_batches={self.rollback_skip_batches}` must be >= 0"
        if self.max_rollbacks < 1:
            return f"`max_rollbacks={self.max_rollbacks}` must be at least 1"
        if self.max_rollbacks > MAX_ROLLBACKS:
            return (
                f"`max_rollbacks={self.max_rollbacks}` must be at most {MAX_ROLLBACKS} (each rollback trains "
                "again from a checkpoint; a run that spikes that often needs a lower learning rate or clipping)"
            )
        return None


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """What the Checkpointer keeps, how it restores and how it writes."""

    max_checkpoints: int = 3  # Checkpoints kept in <model_dir>/checkpoints; older ones are deleted.
    # An unreadable latest checkpoint: set it aside and restore the newest readable one
    # (instead of refusing to start).
    restore_fallback: bool = False
    # Restore from this model_dir instead of the one written (a non-chief worker writes
    # to a private model_dir but resumes from the chief's).
    restore_dir: str | None = None
    reset_optimizer: bool = False  # Restore the weights and step, not the optimizer's slots.
    # Write checkpoints in the background: a save waits only for a copy of the variables in host
    # memory (`engine.checkpointing.background`); the Trainer turns it off where the strategy is not verified.
    async_checkpoint: bool = True


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When things happen between compiled calls, in global steps (None: never).

    The outer loop asks it how long the next compiled call may run, so that
    no call runs past an evaluation, a checkpoint or the target step, and
    whether an evaluation or a checkpoint is due after a call.
    """

    steps_per_loop: int = DEFAULT_STEPS_PER_LOOP  # The most steps one compiled call runs.
    eval_every: int | None = None
    checkpoint_every: int | None = None
    log_every: int | None = None  # Progress lines; None: after every loop.

    def loop_length(self, start: int, target: int) -> int:
        """Steps the call starting at `start` may run toward `target`."""
        length = min(self.steps_per_loop, target - start)
        for every in (self.eval_every, self.checkpoint_every):
            if every:
                length = min(length, every - start % every)
        return length

    def evaluates_after(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0)

    def checkpoints_after(self, step: int) -> bool:
        return bool(self.checkpoint_every and step % self.checkpoint_every == 0)
