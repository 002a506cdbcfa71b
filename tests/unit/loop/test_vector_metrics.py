"""Vector-valued metrics are logged per entry, as Keras computes them (issue 47).

`F1Score()` (its default `average=None`) gives one value per class, `Precision` with a
list of thresholds one per threshold: training and evaluation log each as its own scalar
(`f1_score/0`, ...), equal to what Keras `fit` and `evaluate` compute, on one and two
replicas, and the loop neither crashes nor loses its updates.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, NUM_FEATURES, make_arrays, make_trainer

import engine
from engine.metric_values import log_scalars

BATCH = 8
THRESHOLDS = [0.3, 0.6]


def metrics() -> list[keras.metrics.Metric]:
    return [
        keras.metrics.F1Score(),
        keras.metrics.Precision(thresholds=THRESHOLDS, name="precision_at"),
        keras.metrics.Precision(class_id=1, name="precision_1"),  # Scalar: stays one key.
    ]


def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_arrays(n, seed=seed)
    return x, np.eye(NUM_CLASSES, dtype="float32")[y]  # One-hot: what F1Score reads.


def batches(n: int, seed: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(arrays(n, seed)).batch(BATCH)


def model_in(strategy: tf.distribute.Strategy) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((NUM_FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(NUM_CLASSES, activation="softmax"),
            ]
        )
    rng = np.random.RandomState(3)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def keras_logs(values: dict) -> dict[str, float]:
    """Keras's results (vectors among them) keyed as the engine logs them."""
    logs: dict[str, float] = {}
    for name, value in values.items():
        logs.update(log_scalars(name, value))
    return logs


def strategy_of(replicas: int) -> tf.distribute.Strategy:
    return engine.build_strategy("mirrored" if replicas > 1 else "default", cpu_devices=2)


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_vector_metrics_train_and_evaluate_per_entry_as_keras(replicas, tmp_path):
    strategy = strategy_of(replicas)
    model = model_in(strategy)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.5)
    trainer = make_trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=batches(3 * BATCH, 1),
        eval_data=batches(2 * BATCH + 1, 2),  # The last batch of one leaves replica 1 empty.
        global_batch_size=BATCH,
        loss_fn=keras.losses.CategoricalCrossentropy(reduction=None),
        metrics=metrics(),
        cadence=engine.Cadence(steps_per_loop=3),
        model_dir=str(tmp_path),
    )
    logs = trainer.train(3)  # One loop over the whole data.
    result = trainer.evaluate()

    reference = model_in(engine.build_strategy("default"))
    reference.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.CategoricalCrossentropy(), metrics=metrics()
    )
    history = reference.fit(batches(3 * BATCH, 1), epochs=1, verbose=0, shuffle=False).history
    fitted = keras_logs({name: values[-1] for name, values in history.items()})
    evaluated = keras_logs(reference.evaluate(batches(2 * BATCH + 1, 2), verbose=0, return_dict=True))

    keys = [f"f1_score/{c}" for c in range(NUM_CLASSES)] + ["precision_at/0", "precision_at/1", "precision_1"]
    for key in keys:
        np.testing.assert_allclose(logs[key], fitted[key], rtol=1e-5, atol=1e-6, err_msg=f"train {key}")
        np.testing.assert_allclose(result[key], evaluated[key], rtol=1e-5, atol=1e-6, err_msg=f"eval {key}")
    assert len({round(result[f"f1_score/{c}"], 6) for c in range(NUM_CLASSES)}) > 1  # Really per class.
    assert "f1_score" not in result and "precision_at" not in logs
    assert trainer.step == 3 and trainer.checkpoint_manager.latest_checkpoint.endswith("ckpt-3")  # Saved.


def test_log_scalars_keys_every_entry_of_any_rank():
    assert log_scalars("m", np.float32(0.5)) == {"m": 0.5}
    assert log_scalars("m", np.array([1.0, 2.0])) == {"m/0": 1.0, "m/1": 2.0}
    assert log_scalars("m", np.array([[1.0, 2.0]])) == {"m/0_0": 1.0, "m/0_1": 2.0}
    assert log_scalars("m", {"a": 1.0, "b": np.array([3.0])}) == {"m/a": 1.0, "m/b/0": 3.0}
    json.dumps(log_scalars("m", np.array([1.0, 2.0])))  # Plain floats: metrics.json takes them.
