"""Progress lines every `log_every` steps, and a Keras progress bar when
stdout is a terminal.

A line shows the step, the last loop's loss and metrics, examples/sec,
steps/sec and the ETA to the target step. With `log_every`, compiled loops
are cut at multiples of it (`loop_limit`), so lines come exactly there;
`steps_per_loop` stays the longest a loop may be.

The lines go to the engine's logger (`engine.logger`).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import Any

import keras

from engine.callbacks.base import Callback, TrainerView
from engine.errors import UserError
from engine.logger import logger


class Progress(Callback):
    """Logs a progress line every `log_every` steps (every loop when None)."""

    def __init__(self, log_every: int | None = None, *, progress_bar: bool | None = None):
        if log_every is not None and log_every < 0:
            raise UserError(f"`log_every={log_every}` must not be negative (0 logs after every loop)")
        self.log_every = log_every or None
        self._progress_bar = sys.stdout.isatty() if progress_bar is None else progress_bar
        self._bar: keras.utils.Progbar | None = None
        self._rate_since: tuple[int, float] | None = None  # (step, time) after the first loop

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        if self.log_every is None:
            return None
        return self.log_every - step % self.log_every

    def on_train_begin(self, trainer: TrainerView) -> None:
        self._rate_since = None
        self._bar = None

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        target = trainer.target_step or step
        eta = self._eta(step, target, logs)
        if self._progress_bar:
            if self._bar is None:  # Logs are already loop means: show them as they are.
                self._bar = keras.utils.Progbar(target, stateful_metrics=list(logs), unit_name="step")
            self._bar.update(step, values=list(logs.items()), finalize=step >= target)
        if self.log_every is None or step % self.log_every == 0 or step >= target:
            logger.info("step %d/%d  %s  eta=%s", step, target, format_logs(logs), eta)

    def _eta(self, step: int, target: int, logs: Mapping[str, Any]) -> str:
        """Remaining time at the rate since the first loop (which includes tracing)."""
        now = time.perf_counter()
        if self._rate_since is None:
            self._rate_since = (step, now)
            rate = logs.get("steps_per_second") or 0.0
        else:
            since_step, since_time = self._rate_since
            rate = (step - since_step) / max(now - since_time, 1e-9)
        if rate <= 0:
            return "?"
        seconds = max(target - step, 0) / rate
        if seconds >= datetime.timedelta.max.total_seconds():  # A target near 2**63 steps.
            return f">{datetime.timedelta.max.days} days"
        return str(datetime.timedelta(seconds=round(seconds)))


def format_logs(logs: Mapping[str, Any]) -> str:
    return "  ".join(
        f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}" for name, value in logs.items()
    )
