"""ema_decay / --ema_decay: training unchanged, evaluation on the averages, the
training weights restored exactly, resume bitwise, the evaluator and export on the averages."""

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import make_trainer, python_env

import engine
from engine.errors import UserError

REPO = Path(__file__).resolve().parents[2]  # The repository, above tests/unit.
FEATURES, CLASSES, BATCH, DECAY = 6, 3, 16, 0.8


def arrays(n: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, FEATURES).astype("float32")
    return x, (x[:, 0] * CLASSES).astype("int32") % CLASSES


def new_trainer(strategy, *, model_dir=None, reset_optimizer=False, **kwargs):
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(CLASSES)]
        )
        optimizer = keras.optimizers.SGD(0.5, momentum=0.5)
    rng = np.random.RandomState(3)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    x, y = arrays(64)
    ex, ey = arrays(40, seed=1)
    return make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        global_batch_size=BATCH,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True),
        eval_data=tf.data.Dataset.from_tensor_slices((ex, ey)).batch(BATCH),
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        model_dir=model_dir,
        checkpoint=engine.CheckpointOptions(reset_optimizer=reset_optimizer),
        **kwargs,
    )


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_training_is_unchanged_and_evaluation_uses_the_averages(mirrored):
    plain = new_trainer(mirrored, cadence=engine.Cadence(steps_per_loop=1))
    averaged = new_trainer(mirrored, cadence=engine.Cadence(steps_per_loop=1), ema_decay=DECAY)
    expected = None  # The average by hand: the first step's weights, then decay * avg + (1 - decay) * w.
    for step in range(1, 9):
        assert plain.train(step)["loss"] == averaged.train(step)["loss"]
        weights = averaged.model.get_weights()
        assert_bitwise(plain.model.get_weights(), weights)
        expected = (
            weights
            if expected is None
            else [
                np.float32(DECAY) * e + (np.float32(1) - np.float32(DECAY)) * w
                for e, w in zip(expected, weights, strict=True)
            ]
        )

    before = averaged.model.get_weights()
    ema_eval = averaged.evaluate()
    assert_bitwise(before, averaged.model.get_weights())  # The training weights are back, bit for bit.
    with averaged.averaged_weights():
        held = averaged.model.get_weights()
    assert_bitwise(before, averaged.model.get_weights())
    for got, want in zip(held, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    # Evaluating a model whose weights are set to the averages gives the same numbers.
    plain.model.set_weights(held)
    assert plain.evaluate() == ema_eval
    plain.model.set_weights(before)
    assert plain.evaluate() != ema_eval


@pytest.mark.slow
def test_resume_is_bitwise_with_the_averages(mirrored, tmp_path):
    straight = new_trainer(
        mirrored, model_dir=str(tmp_path / "a"), ema_decay=DECAY, cadence=engine.Cadence(steps_per_loop=4)
    )
    straight.train(12)
    first = new_trainer(
        mirrored, model_dir=str(tmp_path / "b"), ema_decay=DECAY, cadence=engine.Cadence(steps_per_loop=4)
    )
    first.train(6)
    resumed = new_trainer(
        mirrored, model_dir=str(tmp_path / "b"), ema_decay=DECAY, cadence=engine.Cadence(steps_per_loop=4)
    )
    assert resumed.step == 6
    resumed.train(12)
    assert_bitwise(straight.model.get_weights(), resumed.model.get_weights())
    with straight.averaged_weights(), resumed.averaged_weights():
        assert_bitwise(straight.model.get_weights(), resumed.model.get_weights())
    assert straight.evaluate() == resumed.evaluate()


def test_reset_optimizer_starts_the_averages_at_the_weights(default, tmp_path):
    new_trainer(default, model_dir=str(tmp_path), ema_decay=DECAY).train(6)
    fresh = new_trainer(
        default,
        model_dir=str(tmp_path),
        ema_decay=DECAY,
        reset_optimizer=True,
    )
    weights = fresh.model.get_weights()
    with fresh.averaged_weights():
        assert_bitwise(weights, fresh.model.get_weights())


def test_bad_ema_settings_are_refused(default):
    with pytest.raises(UserError, match="`ema_decay=1.5` must be between 0 and 1"):
        new_trainer(default, ema_decay=1.5)
    with default.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
        built = keras.optimizers.SGD(0.1)
        built.build(model.trainable_variables)
    x, y = arrays(32)
    with pytest.raises(UserError, match="needs an optimizer that is not built yet"):
        make_trainer(
            default,
            model=model,
            optimizer=built,
            global_batch_size=BATCH,
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
            loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
            ema_decay=0.9,
        )


CLI = [
    "--model=mlp",
    "--dataset=digits",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--global_batch_size=32",
    "--steps_per_loop=10",
    "--eval_every=10",
    "--train_steps=30",
]


def engine_main(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.main", *CLI, *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=200,
    )


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_evaluates_exports_and_keeps_best_with_the_averages(tmp_path):
    from helpers import main_in_process

    run = engine_main(
        "--ema_decay=0.9",
        f"--model_dir={tmp_path}",
        f"--export_dir={tmp_path / 'export'}",
        "--best_checkpoint_metric=loss",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    final = json.loads((tmp_path / "metrics.json").read_text())["eval"]

    # The averages as the last checkpoint holds them (SGD has no slots: its variables 2.. are they;
    # 0 and 1, the iteration count and the rate, are saved under their own names).
    reader = tf.train.load_checkpoint(str(tmp_path / "checkpoints" / "ckpt-30"))
    keys = sorted(
        (k for k in reader.get_variable_to_shape_map() if k.startswith("optimizer/_variables/")),
        key=lambda k: int(k.split("/")[2]),
    )
    averages = [reader.get_tensor(k) for k in keys]
    weights = [
        reader.get_tensor(f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
        for i in range(len(averages))
    ]
    assert len(averages) == len(weights) > 0
    assert any(not np.array_equal(a, w) for a, w in zip(averages, weights, strict=True))

    # The export serves the averages: equal to a model holding them.
    from models.registry import get_model_spec

    spec = get_model_spec("mlp")
    model = spec.build(spec.default_input_shape, 10)
    model.set_weights(averages)  # The optimizer was built on the model's trainable variables, in order.
    inputs = np.random.RandomState(0).rand(5, *spec.default_input_shape).astype("float32")
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    np.testing.assert_allclose(
        served(features=tf.constant(inputs))["logits"].numpy(),
        model(inputs, training=False).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )

    # --mode=eval without the flag evaluates the averages, as the run's own final evaluation did
    # (this evaluation and the refusal below in this process: helpers.main_in_process).
    evaluated = main_in_process(*CLI, "--mode=eval", f"--model_dir={tmp_path}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    again = json.loads((tmp_path / "metrics.json").read_text())["eval"]
    assert again["loss"] == pytest.approx(final["loss"], rel=1e-6) and again["accuracy"] == final["accuracy"]

    # The best checkpoint holds the averages as the model's weights.
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    best_reader = tf.train.load_checkpoint(str(tmp_path / "best" / best["checkpoint"]))
    best_model = [k for k in best_reader.get_variable_to_shape_map() if k.startswith("optimizer/_trainable")]
    best_averages = [k for k in best_reader.get_variable_to_shape_map() if k.startswith("optimizer/_variables/")]
    for key in best_model:
        index = int(key.split("/")[2])
        np.testing.assert_array_equal(
            best_reader.get_tensor(key),
            best_reader.get_tensor(f"optimizer/_variables/{index + 2}/.ATTRIBUTES/VARIABLE_VALUE"),
        )
    assert best_averages

    # A resume with EMA turned off is refused, naming the flag (left out, --ema_decay would be
    # inherited from the model_dir's config.yaml).
    changed = main_in_process(*CLI, "--train_steps=40", "--ema_decay=0", f"--model_dir={tmp_path}")
    assert changed.returncode == 2
    assert "--ema_decay=0.0 differs from --ema_decay=0.9" in changed.stderr
