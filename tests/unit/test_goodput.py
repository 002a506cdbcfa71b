"""Goodput (where a run's wall time went), training TFLOP/s and MFU: the accounting, the
Trainer's figures for research code, and what a command-line run records and shows.

The fractions checked here are accounting checks (which phase a second is booked to),
not speed measurements: speed is the benchmarks' (benchmarks/throughput.py)."""

import json
import textwrap
import time

import keras
import pytest
import tensorflow as tf
from helpers import main_in_process, make_arrays, make_trainer, read_scalars

import engine
from engine.goodput import FIGURES, PHASES, GoodputClock, ModelFlops, breakdown_line, scalars
from models import known_flops_per_example

PARTS = [name for name in FIGURES if name not in ("total_s", "fraction")]


def check_figures(figures):
    """Every field, none negative, the parts within the total, fraction = train / total."""
    assert set(FIGURES) <= set(figures), figures
    assert all(figures[name] >= 0 for name in FIGURES), figures
    assert sum(figures[name] for name in PARTS) <= figures["total_s"] + 1e-9, figures
    assert figures["fraction"] == pytest.approx(figures["train_s"] / figures["total_s"])


# ------------------------------------------------------------------------ the clock


def test_nested_phases_book_each_second_once():
    clock = GoodputClock()
    with clock.phase("eval"):
        time.sleep(0.02)
        with clock.phase("checkpoint"):  # A save inside an evaluation is the save's.
            time.sleep(0.03)
    with clock.phase("train"):
        time.sleep(0.02)
    figures = clock.figures()
    check_figures(figures)
    assert figures["checkpoint_s"] >= 0.03
    assert 0.02 <= figures["eval_s"] < 0.03 + 0.02  # Without the save's 0.03 s.
    assert figures["startup_s"] < 0.02  # Until the first training call, less what was booked before it.


def test_a_call_that_traces_is_compile_time_the_later_ones_are_not():
    clock = GoodputClock()

    @tf.function
    def double(x):
        return 2 * x

    for _ in range(3):
        with clock.call(double, "train"):
            double(tf.constant(1.0))
    with clock.call(double, "train"):  # A new input signature traces again: compile.
        double(tf.constant([1.0, 2.0]))
    assert double.experimental_get_tracing_count() == 2
    assert clock.seconds("compile") > 0 and clock.seconds("train") > 0
    assert clock.seconds("compile") > clock.seconds("train")  # Tracing dwarfs two tiny calls.


def test_the_steps_a_tracing_call_ran_are_training_at_the_steady_calls_time_per_step():
    """A first call of 100 steps that took 0.6 s, of which 0.4 s was steps at the 4 ms a step the
    next calls took: 0.4 s is training, 0.2 s compilation."""
    clock = GoodputClock()

    @tf.function
    def loop(x):
        return x + 1

    def call(steps: int, seconds: float) -> None:
        with clock.call(loop, "train") as span:
            loop(tf.constant(1.0))
            time.sleep(seconds)
            span.steps = steps

    call(100, 0.6)  # Traces: booked to compile first.
    alone = clock.figures()
    assert alone["train_s"] == 0 and alone["compile_s"] >= 0.6  # No steady call yet to go by.
    call(100, 0.4)
    call(100, 0.4)
    figures = clock.figures()
    check_figures(figures)
    steady_per_step = clock.seconds("train") / 200  # What the clock booked to the two steady calls.
    assert figures["train_s"] == pytest.approx(300 * steady_per_step)
    assert figures["compile_s"] == pytest.approx(clock.seconds("compile") - 100 * steady_per_step)
    assert 0.15 <= figures["compile_s"] < 0.2 + 0.25  # The first call's 0.6 s less its 100 steps' ~0.4 s.


def test_the_origin_moves_earlier_only():
    clock = GoodputClock()
    clock.start_from(time.time() - 5)
    clock.start_from(time.time() + 5)
    assert clock.figures()["total_s"] >= 5


def test_breakdown_line_and_scalars():
    measured = {"total_s": 44.9, "train_s": 41.2, "compile_s": 1.8, "fraction": 0.93}
    figures = dict.fromkeys(FIGURES, 0.0) | measured
    line = breakdown_line(figures)
    assert line.startswith("goodput 0.93: train 41.2 s, compile 1.8 s, eval 0 s,"), line
    assert line.endswith("startup 0 s of 44.9 s")
    assert "restart" in breakdown_line(figures | {"restarts": 1, "restarts_lost_s": 7.0})
    assert scalars(figures)["goodput/fraction"] == 0.93
    assert set(PHASES) == {name[:-2] for name in PARTS} - {"startup"}


def test_tflops_and_mfu_only_where_known():
    assert ModelFlops.from_forward(None, 100.0).rates(1000.0) == {}  # FLOPs unknown: nothing, no guess.
    rates = ModelFlops.from_forward(10**9, None).rates(1000.0)
    assert rates == {"tflops": pytest.approx(3.0)}  # 3x the forward pass: no MFU without a peak.
    assert ModelFlops.from_forward(10**9, 6.0).rates(1000.0) == {"tflops": 3.0, "mfu": 0.5}


def test_flops_are_counted_for_graphs_of_known_layers_only():
    inputs = keras.Input((8,))
    known = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(inputs)))
    assert known_flops_per_example(known) == 2 * (8 * 16 + 16 * 4)

    class Scaled(keras.layers.Layer):  # A user's own layer may hide any amount of work.
        def call(self, x):
            return x * 2.0

    hidden = keras.Model(inputs, keras.layers.Dense(4)(Scaled()(inputs)))
    assert known_flops_per_example(hidden) is None

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(tf.zeros((1, 8)))
    assert known_flops_per_example(subclassed) is None


# ------------------------------------------------------------------- the Trainer


def goodput_trainer(tmp_path=None, *, evaluates=False, **kwargs):
    """`make_trainer` on 256 examples, with accuracy (and an eval set of 64 with `evaluates`)."""
    x, y = make_arrays(256)
    eval_data = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).batch(16) if evaluates else None
    return make_trainer(
        arrays=(x, y),
        eval_data=eval_data,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        model_dir=None if tmp_path is None else str(tmp_path / "run"),
        **kwargs,
    )


def test_trainer_goodput_counts_eval_checkpoints_and_writes_scalars(tmp_path, caplog):
    trainer = goodput_trainer(
        tmp_path, evaluates=True, cadence=engine.Cadence(steps_per_loop=5, eval_every=10, checkpoint_every=10)
    )
    with caplog.at_level("INFO", logger="engine"):
        trainer.train(20)
    figures = trainer.goodput()
    check_figures(figures)
    assert figures["eval_s"] > 0 and figures["checkpoint_s"] > 0
    assert figures["compile_s"] > 0 and figures["train_s"] > 0
    assert trainer.eval_loop.experimental_get_tracing_count() == 1  # Timing wraps, never retraces.
    assert any(record.getMessage().startswith("goodput ") for record in caplog.records)
    written = read_scalars(tmp_path / "run" / "train")
    assert {f"goodput/{name}" for name in FIGURES} <= set(written)
    assert list(written["goodput/fraction"]) == [20]  # At the final step.
    assert "tflops" not in written  # No FLOPs given, none guessed.

    restarted = goodput_trainer(tmp_path)
    assert restarted.goodput()["restore_s"] > 0


def test_trainer_shows_tflops_and_mfu_from_the_flops_it_is_given():
    trainer = goodput_trainer(
        cadence=engine.Cadence(steps_per_loop=4), throughput=engine.ThroughputOptions(flops_per_example=1000)
    )
    logs = trainer.train(8)
    assert logs["tflops"] == pytest.approx(3000 * logs["examples_per_second"] / 1e12)
    assert "mfu" not in logs
    trainer = goodput_trainer(
        cadence=engine.Cadence(steps_per_loop=4),
        throughput=engine.ThroughputOptions(flops_per_example=1000, peak_tflops=2.0),
    )
    logs = trainer.train(8)
    assert logs["mfu"] == pytest.approx(logs["tflops"] / 2.0)


@pytest.mark.slow
def test_fraction_is_near_one_without_eval_and_with_rare_checkpoints(tmp_path):
    """Six seconds of training in long loops, a checkpoint at the end of each train() call:
    the rest (start-up, tracing, two saves, the work between loops) is a small part."""
    # The steady rate on this machine now, to size the run.
    sizing = goodput_trainer(cadence=engine.Cadence(steps_per_loop=2000))
    sizing.train(1)
    began = time.perf_counter()
    sizing.train(2001)
    rate = 2000 / (time.perf_counter() - began)

    trainer = goodput_trainer(tmp_path, cadence=engine.Cadence(steps_per_loop=2000, checkpoint_every=0))
    trainer.train(1)  # The call that traces, one step long.
    trainer.train(1 + int(rate * 6.0))
    figures = trainer.goodput()
    check_figures(figures)
    assert figures["fraction"] > 0.8, breakdown_line(figures)
    assert figures["compile_s"] > 0 and figures["checkpoint_s"] > 0


# ------------------------------------------------------------- the command line

CLI_FLAGS = ["--global_batch_size=32", "--steps_per_loop=5"]

SUBCLASSED_NET = """
import keras


class Net(keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.flat = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.logits(self.flat(x))


def build(input_shape, num_classes):
    model = Net(num_classes)
    model(keras.ops.zeros((1, *input_shape)))
    return model
"""


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("step ")]


@pytest.mark.cli
@pytest.mark.slow
def test_cli_records_goodput_tflops_and_mfu(tmp_path):
    model_dir = tmp_path / "run"
    run = main_in_process(
        "--model=cnn",
        *CLI_FLAGS,
        "--train_steps=10",
        "--eval_every=5",
        "--peak_tflops=2",
        f"--model_dir={model_dir}",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((model_dir / "metrics.json").read_text())
    figures = record["goodput"]
    check_figures(figures)
    assert figures["eval_s"] > 0 and figures["train_s"] > 0 and figures["startup_s"] > 0
    assert record["train"]["tflops"] > 0
    assert record["train"]["mfu"] == pytest.approx(record["train"]["tflops"] / 2)
    assert all("  tflops=" in line and "  mfu=" in line for line in progress_lines(run.stderr))
    # The breakdown line and the summary's row show metrics.json's figures.
    assert f"goodput {figures['fraction']:.2f}: train " in run.stderr
    assert "  goodput  " in run.stderr and " TFLOP/s, MFU " in run.stderr
    written = read_scalars(model_dir / "train")
    assert written["goodput/fraction"] == {10: pytest.approx(figures["fraction"])}
    assert {"goodput/total_s", "goodput/eval_s", "tflops", "mfu"} <= set(written)


@pytest.mark.cli
@pytest.mark.slow
def test_cli_omits_mfu_without_a_peak_and_tflops_for_an_uncounted_model(tmp_path):
    """A counted model without a peak: TFLOP/s in metrics.json, but not on a CPU's lines (a figure
    far below any peak tells a person nothing there); an uncounted model: none anywhere."""
    cnn = main_in_process(
        "--model=cnn",
        *CLI_FLAGS,
        "--train_steps=5",
        "--eval_every=0",
        "--mode=train",
        f"--model_dir={tmp_path / 'cnn'}",
    )
    assert cnn.returncode == 0, cnn.stderr[-3000:]
    cnn_record = json.loads((tmp_path / "cnn" / "metrics.json").read_text())
    assert cnn_record["train"]["tflops"] > 0 and "mfu" not in cnn_record["train"]
    lines = progress_lines(cnn.stderr)
    assert lines and not any("tflops=" in line or "mfu=" in line for line in lines)
    assert "TFLOP/s" not in cnn.stderr  # Nor in the summary's throughput row.

    (tmp_path / "subclassed.py").write_text(textwrap.dedent(SUBCLASSED_NET))
    user = main_in_process(
        "--model=subclassed:build",
        *CLI_FLAGS,
        "--train_steps=5",
        "--eval_every=0",
        "--model_dir=run",
        cwd=tmp_path,
    )
    assert user.returncode == 0, user.stderr[-3000:]
    lines = progress_lines(user.stderr)
    assert lines and not any("tflops=" in line or "mfu=" in line for line in lines)
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "tflops" not in record["train"] and "mfu" not in record["train"]
    check_figures(record["goodput"])


def test_restarts_come_from_the_launchers_environment(monkeypatch):
    from engine.goodput import RESTARTS_ENV, RESTARTS_LOST_ENV, restarts_from_environment

    assert restarts_from_environment() == {}  # Never restarted: no such fields.
    monkeypatch.setenv(RESTARTS_ENV, "2")
    monkeypatch.setenv(RESTARTS_LOST_ENV, "12.5")
    assert restarts_from_environment() == {"restarts": 2, "restarts_lost_s": 12.5}
