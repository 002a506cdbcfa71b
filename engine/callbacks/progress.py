"""Progress lines every `log_every` steps, and a progress bar when stdout is
a terminal.

A line shows the step, the last loop's loss and metrics, the learning rate,
examples/s and, once a second loop has given a steady rate, the ETA to the
target step: `step 60/150  loss=0.2239  accuracy=0.91  learning_rate=0.001
95,670 examples/s  eta=0:00:03`. TFLOP/s (and MFU) are shown on an
accelerator, or where a peak was given (`ThroughputOptions.peak_tflops`);
the logs (metrics.json, TensorBoard) keep every figure, steps/s included, at
full precision. Numbers read as a person reads them: 4 significant digits,
thousands apart (`95,670`), never an exponent below 10**15.

On a terminal a line never wraps: it keeps what fits its width (after the
handler's prefix: `engine.logger.message_width`), the step, loss,
examples/s and ETA first, then the metrics, the learning rate, TFLOP/s.
Into a file or a pipe the line is whole, for the tools that read it.

With `log_every`, compiled loops are cut at multiples of it (`loop_limit`),
so lines come exactly there; `steps_per_loop` stays the longest a loop may be.

The lines go to the engine's logger (`engine.logger`). The bar is the
terminal's status line (`engine.status_line`), with the same figures in the
same form: log lines are printed above it, never on it; the full bar stays
on its own line at the target step, and a bar left short by a stop is erased
(by `engine.main` after an error too).
"""

from __future__ import annotations

import datetime
import math
import numbers
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from engine.callbacks.base import Callback, TrainerView
from engine.errors import UserError
from engine.logger import logger, message_width
from engine.status_line import status_line

BAR_WIDTH = 30
# A loop's rates: shown as `95,670 examples/s` (and TFLOP/s, MFU where they mean something), not by name.
RATE_KEYS = ("steps_per_second", "examples_per_second", "tflops", "mfu")
FLOPS_KEYS = ("tflops", "mfu")
# Beyond this a figure (a diverging loss) keeps an exponent: its digits would fill the line.
_LARGEST_WRITTEN_OUT = 1e15


class Progress(Callback):
    """Logs a progress line every `log_every` steps (every loop when None)."""

    def __init__(self, log_every: int | None = None, *, progress_bar: bool | None = None):
        if log_every is not None and log_every < 0:
            raise UserError(f"`log_every={log_every}` must not be negative (0 logs after every loop)")
        self.log_every = log_every or None
        self._progress_bar = progress_bar
        self._bar_stream: TextIO | None = None  # Where this run's bar is drawn; None: no bar.
        self._rate_since: tuple[int, float] | None = None  # (step, time) after the first loop
        self._shows_flops = False  # TFLOP/s on the line: on an accelerator (MFU, where given, always).

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        if self.log_every is None:
            return None
        return self.log_every - step % self.log_every

    def on_train_begin(self, trainer: TrainerView) -> None:
        self._rate_since = None
        stream = sys.stdout
        shown = status_line.wanted(stream) if self._progress_bar is None else self._progress_bar
        self._bar_stream = stream if shown else None
        self._shows_flops = on_accelerator(trainer)

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        target = trainer.target_step or step
        eta = self._eta(step, target)
        if self._bar_stream is not None:
            text = bar_text(step, target, logs, eta, width=status_line.width(), flops=self._shows_flops)
            status_line.show(text, self._bar_stream)
            if step >= target:  # The full bar stays, as Keras's does; the lines go on below it.
                status_line.finish()
        if self.log_every is None or step % self.log_every == 0 or step >= target:
            text = progress_text(step, target, logs, eta, width=message_width(), flops=self._shows_flops)
            logger.info("%s", text)

    def on_train_end(self, trainer: TrainerView, logs: Mapping[str, Any]) -> None:
        if self._bar_stream is not None:  # Stopped short of the target: the bar goes.
            status_line.clear()

    def _eta(self, step: int, target: int) -> str | None:
        """Remaining time at the rate since the end of the first loop: the first one traces and
        compiles, so its rate says nothing of the rest (None, not shown, until a second loop has run)."""
        now = time.perf_counter()
        if self._rate_since is None:
            self._rate_since = (step, now)
            return None if step < target else "0:00:00"
        since_step, since_time = self._rate_since
        rate = (step - since_step) / max(now - since_time, 1e-9)
        if rate <= 0:
            return None
        seconds = max(target - step, 0) / rate
        if seconds >= datetime.timedelta.max.total_seconds():  # A target near 2**63 steps.
            return f">{datetime.timedelta.max.days} days"
        return str(datetime.timedelta(seconds=round(seconds)))


def on_accelerator(trainer: Any) -> bool:
    """Whether the trainer's replicas run on GPUs or TPUs, where TFLOP/s say how much of the chip a
    run uses; a CPU's figure is far below any peak and tells a person nothing (metrics.json keeps it)."""
    try:
        devices = [str(device) for device in trainer.strategy.extended.worker_devices]
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):  # The default strategy has none.
        import tensorflow as tf

        devices = [device.name for device in tf.config.list_logical_devices()]
    return any(kind in device.upper() for device in devices for kind in ("GPU:", "TPU:"))


def human_number(value: Any) -> str:
    """A figure as a person reads it: 4 significant digits (`0.2239`, `12.35`, `0.00001234`), whole
    and thousands apart from 1,000 on (`95,670`), an exponent only from 10**15 on; integers whole."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    number = float(value)
    size = abs(number)
    if not math.isfinite(number) or size >= _LARGEST_WRITTEN_OUT:
        return f"{number:.4g}"
    if size >= 1000:
        return f"{number:,.0f}"
    if size >= 1e-4 or size == 0:
        return f"{number:.4g}"  # No exponent in this range.
    decimals = 3 - math.floor(math.log10(size))  # 4 significant digits, written out.
    return f"{number:.{decimals}f}".rstrip("0")


def format_logs(logs: Mapping[str, Any]) -> str:
    """`loss=0.2239  accuracy=0.91  num_examples=297`: every entry, figures as `human_number` writes them."""
    return "  ".join(f"{name}={human_number(value)}" for name, value in logs.items())


def line_fields(logs: Mapping[str, Any], eta: str | None, *, flops: bool) -> list[tuple[int, str]]:
    """What a progress line and the bar show after their head, in order, each with its rank (0 is
    kept first where the width is short): the ETA, the loss, examples/s, the other metrics, the
    learning rate(s), then TFLOP/s and MFU (where `flops`, or where a peak gave an MFU)."""
    fields = []
    for name, value in logs.items():
        if name in RATE_KEYS:
            continue
        rank = 1 if name == "loss" else 4 if name.startswith("learning_rate") else 3
        fields.append((rank, f"{name}={human_number(value)}"))
    if logs.get("examples_per_second") is not None:
        fields.append((2, f"{human_number(logs['examples_per_second'])} examples/s"))
    if flops or "mfu" in logs:
        fields.extend((5, f"{key}={human_number(logs[key])}") for key in FLOPS_KEYS if key in logs)
    if eta is not None:
        fields.append((0, f"eta={eta}"))
    return fields


def fit_fields(head: str, fields: Sequence[tuple[int, str]], width: int | None) -> str:
    """`head` and the fields' texts two spaces apart in at most `width` characters (None: all of
    them): the fields of the highest rank (the last of them first) are left out until it fits."""
    kept = list(fields)
    text = "  ".join([head, *(field for _, field in kept)])
    while width is not None and len(text) > width and kept:
        del kept[max(range(len(kept)), key=lambda index: (kept[index][0], index))]
        text = "  ".join([head, *(field for _, field in kept)])
    return text


def progress_text(
    step: int,
    target: int,
    logs: Mapping[str, Any],
    eta: str | None,
    *,
    width: int | None = None,
    flops: bool = False,
) -> str:
    """`step 60/150  loss=0.2239  accuracy=0.91  learning_rate=0.001  95,670 examples/s  eta=0:00:03`
    in at most `width` characters (None: whole): what does not fit is left out (`line_fields`)."""
    return fit_fields(f"step {step}/{target}", line_fields(logs, eta, flops=flops), width)


def bar_text(
    step: int, target: int, logs: Mapping[str, Any], eta: str | None, *, width: int = 80, flops: bool = False
) -> str:
    """`  7/20 [==========>...................]  loss=0.25  95,670 examples/s  eta=0:00:03`: the bar
    and the progress line's figures in its form, in at most `width` characters; the bar narrows
    (to 5) to keep the ETA, loss and examples/s, the other figures are left out as the line's are."""
    counter = f"{step:>{len(str(target))}}/{target}"
    fields = line_fields(logs, eta, flops=flops)
    first = sum(len(field) + 2 for rank, field in fields if rank <= 2)
    bar_width = max(min(BAR_WIDTH, width - len(counter) - 3 - first), 5)
    done = min(step / target, 1.0) if target > 0 else 1.0
    filled = int(bar_width * done)
    bar = "=" * filled + (">" if filled < bar_width else "") + "." * max(bar_width - filled - 1, 0)
    return fit_fields(f"{counter} [{bar}]", fields, width)
