"""`--histogram_every=N` / `WeightHistograms(N)`: a histogram of every weight
in the `train` run every N steps, read back from the event files."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import loss_fn, main_in_process, make_arrays, make_model, make_trainer

import engine
from engine.cli.config.settings import RunConfig
from engine.cli.run.hooks_from_flags import hooks_from_config
from engine.hooks import WeightHistograms


def read_histograms(log_dir: str) -> dict[str, dict[int, np.ndarray]]:
    """tag -> step -> the (left edge, right edge, count) buckets TensorBoard reads."""
    found: dict[str, dict[int, np.ndarray]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "histograms":
                    found.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
    return found


def test_every_weight_is_written_every_n_steps_without_a_retrace(mirrored, tmp_path):
    x, y = make_arrays(64)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        model_dir=str(tmp_path),
        cadence=engine.Cadence(steps_per_loop=3),
        callbacks=[WeightHistograms(4)],
    )
    trainer.train(12)
    assert trainer.train_loop.experimental_get_tracing_count() == 1

    histograms = read_histograms(str(tmp_path / "train"))
    assert sorted(histograms) == sorted(weight.path for weight in model.weights)
    for weight in model.weights:
        by_step = histograms[weight.path]
        assert sorted(by_step) == [4, 8, 12]
        buckets = by_step[12]  # The final weights: every element counted, the edges their range.
        values = weight.numpy()
        assert buckets[:, 2].sum() == values.size
        assert buckets[0, 0] == pytest.approx(values.min()) and buckets[-1, 1] == pytest.approx(values.max())
    kernel = model.weights[0].path
    assert not np.array_equal(histograms[kernel][4], histograms[kernel][12])  # Training moved them.


def test_the_flag_builds_the_hook_and_is_validated():
    assert any(
        isinstance(h, WeightHistograms) and h.every == 7
        for h in hooks_from_config(RunConfig().decisions, RunConfig(histogram_every=7).summaries)
    )
    assert not any(
        isinstance(h, WeightHistograms) for h in hooks_from_config(RunConfig().decisions, RunConfig().summaries)
    )
    with pytest.raises(engine.UserError, match="--histogram_every=-1 must be at least 0"):
        RunConfig(histogram_every=-1).validate()


@pytest.mark.cli
@pytest.mark.slow
def test_histograms_from_the_command_line(tmp_path):
    result = main_in_process(  # 10 steps: the command line in this process
        "--model=mlp", "--train_steps=10", "--histogram_every=5", "--eval_every=0", f"--model_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    histograms = read_histograms(str(tmp_path / "train"))
    assert len(histograms) == 4  # mlp: two Dense layers' kernels and biases.
    assert all(sorted(steps) == [5, 10] for steps in histograms.values())


def read_scalars(log_dir: str, tag: str) -> dict[int, float]:
    found = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    found[event.step] = float(tf.make_ndarray(value.tensor))
    return found


def hand_gradient_norm(model, x, y) -> float:
    """The norm of the gradient of the global batch's mean loss (what two replicas' summed gradients make)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(loss_fn()(y, model(x, training=True)))
    return float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))


@pytest.mark.parametrize("clip_norm", [None, pytest.param(0.05, marks=pytest.mark.slow)])
def test_the_global_gradient_norm_is_written_beside_the_histograms(mirrored, default, tmp_path, clip_norm):
    x, y = make_arrays(64)
    model, optimizer = make_model(mirrored)
    reference, _ = make_model(default)  # The same start on one device, stepped by hand.
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        model_dir=str(tmp_path),
        cadence=engine.Cadence(steps_per_loop=1),
        step=engine.StepOptions(clip_norm=clip_norm),
        callbacks=[WeightHistograms(2)],
    )
    expected = {}
    for step in range(1, 4):
        batch = slice((step - 1) * 16, step * 16)
        reference.set_weights(model.get_weights())
        expected[step] = hand_gradient_norm(reference, x[batch], y[batch])  # Before clipping.
        logs = trainer.train(step)
        assert logs["grad_norm"] == pytest.approx(expected[step], rel=1e-5)
    written = read_scalars(str(tmp_path / "train"), "grad_norm")
    assert sorted(written) == [1, 2, 3]
    for step, value in written.items():
        assert value == pytest.approx(expected[step], rel=1e-5)
    if clip_norm:
        assert min(expected.values()) > clip_norm  # The norm reported is the one before clipping.


def test_no_gradient_norm_without_histograms(default):
    x, y = make_arrays(32)
    model, optimizer = make_model(default)
    trainer = make_trainer(default, model=model, optimizer=optimizer, arrays=(x, y))
    assert "grad_norm" not in trainer.train(2)
