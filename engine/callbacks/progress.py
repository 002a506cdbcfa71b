"""Progress lines every `log_every` steps, and a progress bar when stdout is
a terminal.

A line shows the step, the last loop's loss and metrics, examples/sec,
steps/sec and the ETA to the target step. With `log_every`, compiled loops
are cut at multiples of it (`loop_limit`), so lines come exactly there;
`steps_per_loop` stays the longest a loop may be.

The lines go to the engine's logger (`engine.logger`). The bar is the
terminal's status line (`engine.status_line`): log lines are printed above
it, never on it; the full bar stays on its own line at the target step, and
a bar left short by a stop is erased (by `engine.main` after an error too).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from engine.callbacks.base import Callback, TrainerView
from engine.errors import UserError
from engine.logger import logger
from engine.status_line import status_line

BAR_WIDTH = 30


class Progress(Callback):
    """Logs a progress line every `log_every` steps (every loop when None)."""

    def __init__(self, log_every: int | None = None, *, progress_bar: bool | None = None):
        if log_every is not None and log_every < 0:
            raise UserError(f"`log_every={log_every}` must not be negative (0 logs after every loop)")
        self.log_every = log_every or None
        self._progress_bar = progress_bar
        self._bar_stream: TextIO | None = None  # Where this run's bar is drawn; None: no bar.
        self._rate_since: tuple[int, float] | None = None  # (step, time) after the first loop

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        if self.log_every is None:
            return None
        return self.log_every - step % self.log_every

    def on_train_begin(self, trainer: TrainerView) -> None:
        self._rate_since = None
        stream = sys.stdout
        shown = status_line.wanted(stream) if self._progress_bar is None else self._progress_bar
        self._bar_stream = stream if shown else None

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        target = trainer.target_step or step
        eta = self._eta(step, target)
        if self._bar_stream is not None:
            status_line.show(bar_text(step, target, logs, eta, width=status_line.width()), self._bar_stream)
            if step >= target:  # The full bar stays, as Keras's does; the lines go on below it.
                status_line.finish()
        if self.log_every is None or step % self.log_every == 0 or step >= target:
            logger.info("step %d/%d  %s  eta=%s", step, target, format_logs(logs), eta)

    def on_train_end(self, trainer: TrainerView, logs: Mapping[str, Any]) -> None:
        if self._bar_stream is not None:  # Stopped short of the target: the bar goes.
            status_line.clear()

    def _eta(self, step: int, target: int) -> str:
        """Remaining time at the rate since the end of the first loop: the first one traces and
        compiles, so its rate says nothing of the rest ("?" until a second loop has run)."""
        now = time.perf_counter()
        if self._rate_since is None:
            self._rate_since = (step, now)
            return "?" if step < target else "0:00:00"
        since_step, since_time = self._rate_since
        rate = (step - since_step) / max(now - since_time, 1e-9)
        if rate <= 0:
            return "?"
        seconds = max(target - step, 0) / rate
        if seconds >= datetime.timedelta.max.total_seconds():  # A target near 2**63 steps.
            return f">{datetime.timedelta.max.days} days"
        return str(datetime.timedelta(seconds=round(seconds)))


def bar_text(step: int, target: int, logs: Mapping[str, Any], eta: str, *, width: int = 80) -> str:
    """`  7/20 [==========>...................] eta 0:00:03  loss: 0.2500  accuracy: 0.9000`, the
    values as Keras's progress bar shows them, in at most `width` characters: the bar narrows
    to keep the ETA on the line, and the values that do not fit are left out."""
    counter = f"{step:>{len(str(target))}}/{target}"
    tail = f" eta {eta}"
    bar_width = max(min(BAR_WIDTH, width - len(counter) - len(tail) - 3), 5)
    done = min(step / target, 1.0) if target > 0 else 1.0
    filled = int(bar_width * done)
    bar = "=" * filled + (">" if filled < bar_width else "") + "." * max(bar_width - filled - 1, 0)
    text = f"{counter} [{bar}]{tail}"
    for name, value in logs.items():
        shown = f"  {name}: {_bar_value(value)}"
        if len(text) + len(shown) > width:
            break
        text += shown
    return text


def _bar_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.4e}"
    return str(value)


def format_logs(logs: Mapping[str, Any]) -> str:
    return "  ".join(
        f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}" for name, value in logs.items()
    )
