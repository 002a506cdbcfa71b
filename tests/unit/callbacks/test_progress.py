"""Progress lines every --log_every steps, loops cut to match, ETA, and the
progress bar a terminal gets."""

import logging
import re

import pytest
from helpers import make_arrays, make_model, make_trainer

import engine
from engine.callbacks.progress import Progress, bar_text


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
    assert re.search(
        r"loss=\S+  steps_per_second=\S+  examples_per_second=\S+  "
        r"learning_rate=0.5  eta=\d+:\d\d:\d\d$",
        progress[0],
    ), progress[0]
    assert trainer.train_loop.experimental_get_tracing_count() == 1


def test_progress_bar_shows_on_a_terminal(capsys):
    progress = Progress(progress_bar=True)
    trainer = type("FakeTrainer", (), {"target_step": 10})()
    progress.on_train_begin(trainer)
    progress.on_loop_end(trainer, 5, {"loss": 0.5, "steps_per_second": 10.0})
    progress.on_loop_end(trainer, 10, {"loss": 0.25, "steps_per_second": 10.0})
    out = capsys.readouterr().out
    assert "10/10" in out and "loss: 0.2500" in out


LOGS = {"loss": 0.25, "accuracy": 0.9, "steps_per_second": 123.4, "examples_per_second": 15000.0}


@pytest.mark.parametrize("width", [30, 60, 79, 200])
def test_the_bar_fits_the_terminal_and_always_shows_its_eta(width):
    text = bar_text(70, 2000, LOGS, "0:01:46", width=width)
    assert len(text) <= width, text
    assert re.fullmatch(r"  70/2000 \[=?>\.+\] eta 0:01:46(  \w+: \S+)*", text), text
    shown = re.findall(r"  (\w+): ", text)
    assert shown == list(LOGS)[: len(shown)]  # The values in order, those that fit.
    assert (len(shown) == len(LOGS)) == (width == 200)


def test_the_first_eta_leaves_the_first_loop_out(capsys):
    """The first loop traces and compiles: its rate would promise minutes for seconds of work."""
    progress = Progress(progress_bar=True)
    trainer = type("FakeTrainer", (), {"target_step": 100})()
    progress.on_train_begin(trainer)
    progress.on_loop_end(trainer, 10, {"loss": 0.5, "steps_per_second": 0.01})
    assert capsys.readouterr().out.endswith("eta ?  loss: 0.5000")
    progress.on_loop_end(trainer, 20, {"loss": 0.5, "steps_per_second": 0.01})
    assert re.search(r"eta \d+:\d\d:\d\d  loss: 0.5000$", capsys.readouterr().out)


def test_negative_log_every_is_refused():
    with pytest.raises(engine.UserError, match="`log_every=-1` must not be negative"):
        Progress(-1)
