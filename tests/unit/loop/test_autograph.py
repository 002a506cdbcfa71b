"""AutoGraph in the compiled step (engine.compat.engine_graph_code / user_code): the engine's own
step code is traced as written, which spared each process some 200 conversions (about 3 s of
CPU before its first step), while the user's code (a tf.Module model, a loss function, a
metric, an eval step, a step_fn) is still converted as tf.function converts it, so a Python
`if` or `for` over tensors there keeps working and computes what eager code computes."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, NUM_FEATURES, global_batches, make_arrays, make_model, make_trainer
from tensorflow.python.autograph.impl import api as autograph_api

import engine

STEPS = 4
BATCH = 16


class BranchingModel(tf.Module):
    """A research model whose call needs AutoGraph: a Python `if` and `for` over tensors."""

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(1)
        self.kernel = tf.Variable(rng.normal(0, 0.3, (NUM_FEATURES, NUM_CLASSES)).astype("float32"))
        self.bias = tf.Variable(np.zeros(NUM_CLASSES, "float32"))

    def __call__(self, x):
        logits = x @ self.kernel + self.bias
        if tf.reduce_max(tf.abs(logits)) > 1e6:  # Never taken: a guard a user might write.
            logits = logits * 0.0
        for _ in tf.range(2):  # A loop over a tensor: two halvings of a doubled value.
            logits = logits * 0.5
        return logits * 4.0


def branching_loss(labels, logits):
    """A per-example loss whose Python `if` on a tensor needs AutoGraph."""
    per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    if tf.reduce_any(tf.math.is_nan(per_example)):
        per_example = tf.zeros_like(per_example)
    return per_example


class BranchingCount(keras.metrics.Metric):
    """A user's metric whose update has a Python `if` on a tensor: how many examples it saw."""

    def __init__(self, name="seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_weight(name="total", shape=(), initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        if tf.size(y_true) > 0:
            self.total.assign_add(tf.cast(tf.size(y_true), tf.float32))

    def result(self):
        return tf.convert_to_tensor(self.total)


def eager_reference(x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The same training in plain eager TensorFlow: one process, no tf.function."""
    model = BranchingModel()
    optimizer = keras.optimizers.SGD(0.5)
    batches = list(global_batches(x, y, BATCH).take(STEPS))
    for features, labels in batches:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(branching_loss(labels, model(features)))
        gradients = tape.gradient(loss, [model.kernel, model.bias])
        optimizer.apply(gradients, [model.kernel, model.bias])
    return [model.kernel.numpy(), model.bias.numpy()]


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_a_users_branching_model_loss_and_metric_train_as_in_eager_code(strategy_name, request):
    strategy = request.getfixturevalue(strategy_name)
    x, y = make_arrays(BATCH * STEPS)
    with strategy.scope():
        model = BranchingModel()
        optimizer = keras.optimizers.SGD(0.5)
        seen = BranchingCount()
    trainer = make_trainer(
        strategy,
        arrays=(x, y),
        model=model,
        optimizer=optimizer,
        loss_fn=branching_loss,
        metrics=[seen],
        eval_data=global_batches(x, y, BATCH).take(2),
        cadence=engine.Cadence(steps_per_loop=2),
    )
    trainer.train(STEPS)
    expected = eager_reference(x, y)
    for actual, reference in zip([model.kernel.numpy(), model.bias.numpy()], expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-5, atol=1e-6)
    results = trainer.evaluate()
    assert results["num_examples"] == 2 * BATCH and results["seen"] == 2 * BATCH, results
    predicted = trainer.predict(x[:5])
    np.testing.assert_allclose(
        predicted, BranchingModel.__call__(model, tf.constant(x[:5])), rtol=1e-5, atol=1e-6
    )


def test_a_step_fn_and_an_eval_step_fn_with_tensor_control_flow_run(default):
    x, y = make_arrays(BATCH * STEPS)
    model, optimizer = make_model(default)

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(branching_loss(labels, model(features, training=True)))
        gradients = tape.gradient(loss, model.trainable_variables)
        if loss > 0.0:  # A tensor condition: AutoGraph makes it a tf.cond.
            optimizer.apply(gradients, model.trainable_variables)
        return {"loss": loss}

    def eval_step_fn(batch):
        features, labels = batch
        outputs = model(features, training=False)
        if tf.shape(labels)[0] > 0:
            outputs = outputs + 0.0
        return labels, outputs

    custom = make_trainer(
        default,
        arrays=(x, y),
        model=model,
        optimizer=optimizer,
        step_fn=step_fn,
        eval_step_fn=eval_step_fn,
        eval_data=global_batches(x, y, BATCH).take(1),
    )
    before = [w.copy() for w in model.get_weights()]
    logs = custom.train(STEPS)
    assert np.isfinite(logs["loss"]) and any(
        not np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True)
    )
    assert custom.evaluate()["num_examples"] == BATCH


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_the_engines_step_code_is_traced_as_written_and_only_its_loops_are_converted(mirrored, monkeypatch):
    """What AutoGraph converts while a Trainer (train, evaluate, predict, with gradient
    accumulation) is traced on two replicas: the compiled loops, and nothing else of the engine."""
    converted: collections.Counter[str] = collections.Counter()
    convert = autograph_api._convert_actual

    def counted(entity, program_ctx):
        converted[f"{entity.__module__}.{entity.__qualname__}"] += 1
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", counted)
    x, y = make_arrays(BATCH * STEPS)
    trainer = make_trainer(
        mirrored,
        arrays=(x, y),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        eval_data=global_batches(x, y, BATCH).take(1),
        cadence=engine.Cadence(steps_per_loop=2),
        step=engine.StepOptions(grad_accum_steps=2, clip_norm=1.0),
    )
    trainer.train(STEPS)
    trainer.evaluate()
    trainer.predict(x[:5])
    engine_functions = sorted(name for name in converted if name.startswith(("engine.", "input.")))
    loops = [name for name in engine_functions if name.endswith(("train_loop", "eval_loop", "predict_batch"))]
    assert loops and engine_functions == loops, engine_functions


def test_resident_data_with_a_users_indices_transform_and_step_fn_that_branch_on_tensors(mirrored):
    """The resident loop gathers each batch on the replicas through the user's `indices` and
    `transform` and runs the user's `step_fn`: all three keep AutoGraph there too."""
    x, y = make_arrays(BATCH * STEPS)
    model, optimizer = make_model(mirrored)

    def indices(positions):
        if tf.reduce_min(positions) < 0:  # Never: positions count up from 0.
            positions = -positions
        return positions % (BATCH * STEPS)

    def transform(batch):
        features, labels = batch
        if tf.reduce_max(features) > 1.0:  # Never: make_arrays draws from [0, 1).
            features = features / 255.0
        return features, labels

    seen = []

    def step_fn(batch):
        features, labels = batch
        seen.append(features.shape)
        with tf.GradientTape() as tape:
            per_example = branching_loss(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        scale = tf.constant(1.0)
        if loss > 1e6:  # A tensor condition (never true here); an update inside one could not all-reduce.
            scale = tf.constant(0.0)
        optimizer.apply([g * scale for g in gradients], model.trainable_variables)
        return {"loss": tf.reduce_mean(per_example)}

    data = engine.ResidentData(
        tensors=(x, y), indices=indices, host_data=global_batches(x, y, BATCH), transform=transform
    )
    before = [w.copy() for w in model.get_weights()]
    trainer = make_trainer(mirrored, model=model, optimizer=optimizer, train_data=data, step_fn=step_fn)
    logs = trainer.train(STEPS)
    assert trainer.step == STEPS and np.isfinite(logs["loss"]) and seen
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
