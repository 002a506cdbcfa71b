"""mixed_float16 with a plain optimizer trains under a loss scale, as Keras `compile()` has it (issue 47).

A small loss (scaled by 1e-5) has float16 gradients that underflow to zero without a
loss scale: most weights then never move. The engine wraps the optimizer as `compile()`
does, so its weights after two steps are `fit`'s, on one and two replicas; the scale is
optimizer state, restored on resume.

Covers: engine/precision.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, NUM_FEATURES, make_arrays, make_trainer

import engine

BATCH = 8
# A loss this small has float16 gradients below float16's smallest number; the rate makes its update visible.
FACTOR, LEARNING_RATE = 1e-7, 1e5


@pytest.fixture
def float16_policy():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def scaled_loss(factor: float):
    def loss(labels, logits):  # Per example: the engine's loss_fn, and compile()'s loss alike.
        return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True) * factor

    return loss


def float16_model(strategy: tf.distribute.Strategy) -> keras.Model:
    """A model computing in float16 (float32 logits, as Keras advises), from the same weights each time."""
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((NUM_FEATURES,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(NUM_CLASSES, dtype="float32"),
            ]
        )
    rng = np.random.RandomState(5)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def data(steps: int) -> tf.data.Dataset:
    x, y = make_arrays(BATCH * steps, seed=2)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def engine_trainer(
    strategy, factor: float, steps: int, model_dir=None, learning_rate: float = LEARNING_RATE
) -> engine.Trainer:
    model = float16_model(strategy)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(learning_rate)
    return make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=data(steps),
        global_batch_size=BATCH,
        loss_fn=scaled_loss(factor),
        cadence=engine.Cadence(steps_per_loop=1),
        model_dir=model_dir,
    )


def strategy_of(replicas: int) -> tf.distribute.Strategy:
    return engine.build_strategy("mirrored" if replicas > 1 else "default", cpu_devices=2)


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_plain_optimizer_under_mixed_float16_trains_as_fit_with_its_loss_scale(float16_policy, replicas):
    strategy = strategy_of(replicas)
    reference = float16_model(strategy)
    start = [w.copy() for w in reference.get_weights()]
    with strategy.scope():
        reference.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=scaled_loss(FACTOR))
    assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)  # What compile() does.
    reference.fit(data(2), epochs=1, verbose=0, shuffle=False)

    trainer = engine_trainer(strategy, FACTOR, 2)
    trainer.train(2)

    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    ours, theirs = trainer.model.get_weights(), reference.get_weights()
    moved = sum(int(np.sum(a != b)) for a, b in zip(ours, start, strict=True))
    assert (
        moved
        == sum(int(np.sum(a != b)) for a, b in zip(theirs, start, strict=True))
        > 0.5 * sum(w.size for w in start)
    )  # 243 of 323; without the scale 75 (the others' float16 gradients underflow to zero).
    names = [w.path for w in reference.weights]
    for name, mine, keras_value, first in zip(names, ours, theirs, start, strict=True):
        # fit's update, to float16 arithmetic's precision.
        np.testing.assert_allclose(mine - first, keras_value - first, rtol=1e-3, atol=1e-9, err_msg=name)


def test_the_loss_scale_is_restored_on_resume_bitwise(float16_policy, tmp_path):
    """A large loss overflows float16 under the initial scale: the scale halves on those steps,
    and a resumed run must go on from the halved scale, not the initial one."""
    strategy = strategy_of(1)
    whole = engine_trainer(strategy, 1e4, 6, learning_rate=1e-5)
    whole.train(6)
    assert float(whole.optimizer.dynamic_scale.numpy()) < whole.optimizer.initial_scale  # It did change.

    first = engine_trainer(strategy, 1e4, 6, str(tmp_path), learning_rate=1e-5)
    first.train(3)
    first.close()
    resumed = engine_trainer(strategy, 1e4, 6, str(tmp_path), learning_rate=1e-5)
    assert resumed.step == 3
    saved_scale = float(first.optimizer.dynamic_scale.numpy())
    assert saved_scale < first.optimizer.initial_scale
    assert float(resumed.optimizer.dynamic_scale.numpy()) == saved_scale
    resumed.train(6)
    assert float(resumed.optimizer.dynamic_scale.numpy()) == float(whole.optimizer.dynamic_scale.numpy())
    for a, b in zip(resumed.model.get_weights(), whole.model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_step_fn_keeps_its_own_optimizer(float16_policy):
    """A step_fn applies the optimizer it holds (its loss scaling is its own): nothing is wrapped."""
    strategy = strategy_of(1)
    model = float16_model(strategy)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=data(2),
        global_batch_size=BATCH,
        step_fn=lambda batch: {"loss": tf.constant(0.0)},
        loss_fn=None,
    )
    assert trainer.optimizer is optimizer
