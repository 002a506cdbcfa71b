"""Progress lines every --log_every steps, loops cut to match, ETA, and the
progress bar a terminal gets; figures as a person reads them, lines that fit
the terminal.

Covers: engine/callbacks/progress.py, engine/logger.py.
"""

import io
import logging
import math
import re

import pytest
from helpers import make_arrays, make_model, make_trainer

import engine
from engine import logger as engine_logger
from engine.callbacks.progress import (
    Progress,
    bar_text,
    format_logs,
    human_number,
    on_accelerator,
    progress_text,
)
from engine.logger import wrap_line


@pytest.fixture
def log_lines(caplog):
    """The lines of the "engine" logger, where the trainer's progress goes."""
    caplog.set_level(logging.INFO, logger="engine")

    class Lines:
        def __iter__(self):
            return iter([r.getMessage() for r in caplog.records if r.name == "engine"])

    return Lines()


def test_log_every_cuts_loops_and_logs_at_its_multiples(log_lines):
    strategy = engine.build_strategy("mirrored", cpu_devices=2)
    x, y = make_arrays(32)
    model, optimizer = make_model(strategy)
    loops = []
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        cadence=engine.Cadence(steps_per_loop=4, log_every=6),
        callbacks=[lambda trainer, step, logs: loops.append(step)],
    )
    trainer.train(15)
    assert loops == [4, 6, 10, 12, 15]  # steps_per_loop is the longest loop; cut at 6 and 12
    progress = [line for line in log_lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["6/15", "12/15", "15/15"]
    assert re.fullmatch(
        r"step 6/15  loss=\S+  learning_rate=0.5  [\d,.]+ examples/s  eta=\d+:\d\d:\d\d",
        progress[0],
    ), progress[0]
    assert trainer.train_loop.experimental_get_tracing_count() == 1


class _Trainer:
    """What Progress reads of a trainer: the target, and the strategy's devices (a CPU's here)."""

    def __init__(self, target_step: int, device: str = "/job:localhost/replica:0/task:0/device:CPU:0"):
        self.target_step = target_step
        self.strategy = type("Strategy", (), {"extended": type("Extended", (), {"worker_devices": (device,)})})()


def test_progress_bar_shows_on_a_terminal(capsys):
    progress = Progress(progress_bar=True)
    trainer = _Trainer(10)
    progress.on_train_begin(trainer)
    progress.on_loop_end(trainer, 5, {"loss": 0.5, "steps_per_second": 10.0})
    progress.on_loop_end(trainer, 10, {"loss": 0.25, "steps_per_second": 10.0})
    out = capsys.readouterr().out
    assert "10/10" in out and "loss=0.25" in out


LOGS = {
    "loss": 0.25,
    "accuracy": 0.9,
    "steps_per_second": 123.4,
    "examples_per_second": 95670.3,
    "tflops": 0.0123,
    "learning_rate": 0.001,
}


@pytest.mark.parametrize("width", [30, 60, 79, 200])
def test_the_bar_fits_the_terminal_and_always_shows_its_eta(width):
    text = bar_text(70, 2000, LOGS, "0:01:46", width=width)
    assert len(text) <= width, text
    assert re.fullmatch(r"  70/2000 \[=?>\.+\](  .+)?  eta=0:01:46", text), text
    shown = [name for name in re.findall(r"  (\w+)=", text) if name != "eta"]
    assert shown == [name for name in ("loss", "accuracy", "learning_rate") if name in shown]
    assert (shown == ["loss", "accuracy", "learning_rate"]) == (width == 200)
    assert (" examples/s" in text) == (width >= 60)  # Kept before the other figures, the bar narrowed.


def test_the_bar_shows_the_lines_figures_in_their_form():
    line = progress_text(70, 2000, LOGS, "0:01:46")
    bar = bar_text(70, 2000, LOGS, "0:01:46", width=200)
    assert line == "step 70/2000  loss=0.25  accuracy=0.9  learning_rate=0.001  95,670 examples/s  eta=0:01:46"
    assert bar.split("]", 1)[1] == line.removeprefix("step 70/2000")


@pytest.mark.parametrize("width", [20, 40, 60, 80, 120])
def test_a_progress_line_keeps_what_fits_the_step_eta_loss_and_rate_first(width):
    logs = {**LOGS, "precision": 0.91234, "recall": 0.8765, "learning_rate": 0.000123}
    text = progress_text(123, 1000, logs, "0:00:42", width=width)
    assert len(text) <= width or text == "step 123/1000", text
    fields = text.split("  ")
    assert fields[0] == "step 123/1000"
    whole = progress_text(123, 1000, logs, "0:00:42").split("  ")
    assert fields == [field for field in whole if field in fields]  # In the line's order, none changed.
    wanted = [
        "eta=0:00:42",
        "loss=0.25",
        "95,670 examples/s",
        "accuracy=0.9",
        "precision=0.9123",
        "recall=0.8765",
        "learning_rate=0.000123",
    ]
    assert sorted(wanted) == sorted(whole[1:])
    # The least wanted go first.
    assert [field for field in wanted if field in fields] == wanted[: len(fields) - 1], text


def test_tflops_only_on_an_accelerator_or_where_a_peak_gives_an_mfu():
    assert "tflops" not in progress_text(7, 10, LOGS, None)
    assert "tflops=0.0123" in progress_text(7, 10, LOGS, None, flops=True)
    assert "tflops=0.0123  mfu=0.5" in progress_text(7, 10, {**LOGS, "mfu": 0.5}, None)
    assert not on_accelerator(_Trainer(10))
    assert on_accelerator(_Trainer(10, "/job:worker/replica:0/task:1/device:GPU:0"))
    assert on_accelerator(_Trainer(10, "/job:worker/replica:0/task:0/device:TPU:3"))


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (95670.3, "95,670"),
        (9.567e4, "95,670"),
        (1234.5, "1,234"),  # Half to even, as format() rounds.
        (0.2239123, "0.2239"),
        (12.3456, "12.35"),
        (0.001, "0.001"),
        (1e-05, "0.00001"),
        (1.234567e-07, "0.0000001235"),
        (-3.5e-6, "-0.0000035"),
        (0.0, "0"),
        (10000, "10,000"),
        (297, "297"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (2.5e16, "2.5e+16"),  # A diverging loss keeps its exponent.
        ("none", "none"),
    ],
)
def test_figures_as_a_person_reads_them(value, text):
    assert human_number(value) == text


def test_no_exponent_and_four_significant_digits_from_1e_minus_12_to_1e14():
    for exponent in range(-12, 15):
        for mantissa in (1.0, 1.23456, 9.87654):
            value = mantissa * 10.0**exponent
            text = human_number(value)
            assert "e" not in text, (value, text)
            assert math.isclose(float(text.replace(",", "")), value, rel_tol=5e-4), (value, text)
    logs = {"loss": 0.5, "num_examples": 297, "rate": 9.567e4}
    assert format_logs(logs) == "loss=0.5  num_examples=297  rate=95,670"


def test_a_long_line_breaks_between_its_fields_on_a_terminal():
    line = (
        "done: step 500, eval loss=0.0811  accuracy=0.9764  num_examples=297, "
        "95,670 examples/s; wrote /tmp/x/m.json"
    )
    assert wrap_line(line, None) == line and wrap_line(line, len(line)) == line
    wrapped = wrap_line(line, 60).split("\n")
    assert all(len(part) <= 60 for part in wrapped), wrapped
    assert wrapped == [
        "done: step 500, eval loss=0.0811  accuracy=0.9764",
        "  num_examples=297, 95,670 examples/s; wrote /tmp/x/m.json",
    ]
    assert wrap_line("a_field_longer_than_the_width  b", 10) == "a_field_longer_than_the_width\n  b"
    assert wrap_line("dataset=d  examples (28, 28, 1)", 25) == "dataset=d\n  examples (28, 28, 1)"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_message_width_is_the_terminals_less_the_handlers_prefix(monkeypatch):
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("I 12:00:00 job.py:1] %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(engine_logger.logger, "propagate", True)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert engine_logger.message_width() == 79 - len("I 12:00:00 job.py:1] ")
    monkeypatch.setattr("sys.stderr", io.StringIO())  # A file or a pipe: lines are whole.
    assert engine_logger.message_width() is None


def test_the_first_loop_shows_no_eta(capsys, caplog):
    """The first loop traces and compiles: its rate would promise minutes for seconds of work, so
    the ETA is left out until a second loop has given a rate (never `eta=?`)."""
    caplog.set_level(logging.INFO, logger="engine")
    progress = Progress(progress_bar=True)
    trainer = _Trainer(100)
    progress.on_train_begin(trainer)
    progress.on_loop_end(trainer, 10, {"loss": 0.5, "steps_per_second": 0.01})
    assert capsys.readouterr().out.endswith("]  loss=0.5")
    progress.on_loop_end(trainer, 20, {"loss": 0.5, "steps_per_second": 0.01})
    assert re.search(r"loss=0.5  eta=\d+:\d\d:\d\d$", capsys.readouterr().out)
    lines = [record.getMessage() for record in caplog.records if record.name == "engine"]
    assert lines[0] == "step 10/100  loss=0.5" and re.fullmatch(r"step 20/100  loss=0.5  eta=\S+", lines[1])


def test_negative_log_every_is_refused():
    with pytest.raises(engine.UserError, match="`log_every=-1` must not be negative"):
        Progress(-1)
