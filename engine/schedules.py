"""Learning-rate schedules by name (the command line's `--lr_schedule`), built from Keras's own.

A schedule object is handed to the optimizer, which evaluates it at
`optimizer.iterations`; that counter is in every checkpoint, so a restored
run continues the schedule where it stopped. A constant rate is a plain
float (the optimizer keeps it in a checkpointed variable).
"""

from __future__ import annotations

from typing import TypeAlias

import keras

from engine.errors import UserError
from engine.options import SCHEDULE_NAMES

LearningRate: TypeAlias = float | keras.optimizers.schedules.LearningRateSchedule

STEP_DECAY_RATE = 0.1  # `step`: the rate drops 10x after each third of the run.
DEFAULT_WARMUP_FRACTION = 0.1


def learning_rate_schedule(
    schedule: str, base_rate: float, total_steps: int, warmup_steps: int = 0
) -> LearningRate:
    """The learning rate (or schedule) called `schedule` over a run of `total_steps`.

    - constant: `base_rate` throughout;
    - cosine: cosine decay from `base_rate` to 0 at `total_steps`;
    - step: `base_rate`, then x0.1 after each third of the run;
    - warmup_cosine: linear warmup from 0 over `warmup_steps` (a tenth of
      the run when 0), then cosine decay to 0 at `total_steps`.
    """
    if schedule not in SCHEDULE_NAMES:
        raise UserError(f"unknown `schedule={schedule!r}`; choose one of: {', '.join(SCHEDULE_NAMES)}")
    if total_steps < 1:
        raise UserError(f"a learning-rate schedule needs at least 1 training step, got {total_steps}")
    schedules = keras.optimizers.schedules
    if schedule == "constant":
        return float(base_rate)
    if schedule == "cosine":
        return schedules.CosineDecay(base_rate, decay_steps=total_steps)
    if schedule == "step":
        return schedules.ExponentialDecay(
            base_rate, decay_steps=max(1, total_steps // 3), decay_rate=STEP_DECAY_RATE, staircase=True
        )
    warmup = warmup_steps or max(1, int(total_steps * DEFAULT_WARMUP_FRACTION))
    if warmup >= total_steps:
        raise UserError(
            f"`warmup_steps={warmup}` leaves no steps to decay over in a run of {total_steps}; "
            "use fewer warmup steps or train longer"
        )
    return schedules.CosineDecay(
        0.0, decay_steps=total_steps - warmup, warmup_target=base_rate, warmup_steps=warmup
    )


def is_scheduled(optimizer: keras.optimizers.Optimizer) -> bool:
    """True when the optimizer's rate comes from a schedule, not a variable.

    Keras returns the variable itself for a constant rate and the schedule's
    value (a tensor) otherwise.
    """
    return not isinstance(optimizer.learning_rate, keras.Variable)
