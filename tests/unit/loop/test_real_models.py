"""What real models need beyond the conformance matrix (issue 28): sparse gradients clipped and
accumulated as dense ones, per-token sample weights, the reported evaluation equal to a
restore of the step's checkpoint, every --metrics name on two replicas, and one line for a
custom metric that cannot be copied or an optimizer made outside the strategy's scope.

Covers: engine/losses.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import global_batches, loss_fn, make_arrays, make_model, make_trainer

import engine
from engine import objectives

VOCAB, TOKENS, BATCH = 20, 5, 8


def token_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, TOKENS)).astype("int32")
    for row, length in enumerate(rng.integers(1, TOKENS + 1, size=n)):
        x[row, length:] = 0
    return x, (x % 3).astype("int32"), rng.uniform(0.0, 2.0, size=(n, TOKENS)).astype("float32")


def embedding_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(4)
        tokens = keras.Input((TOKENS,), dtype="int32")
        hidden = keras.layers.Embedding(VOCAB, 6, mask_zero=True)(tokens)
        model = keras.Model(tokens, keras.layers.Dense(3)(hidden))
        optimizer = keras.optimizers.SGD(0.5)
    return model, optimizer


def test_sparse_gradients_clip_and_accumulate_as_a_dense_hand_computation(mirrored):
    """An Embedding's IndexedSlices, two micro-batches on each of two replicas, clipped by the
    global norm: the update equals a plain TF step on the whole batch with dense gradients."""
    x, y, _ = token_data(BATCH)
    model, optimizer = embedding_model(mirrored)
    reference, _ = embedding_model(engine.build_strategy("default"))
    per_token = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
        global_batch_size=BATCH,
        loss_fn=per_token,
        step=engine.StepOptions(clip_norm=0.05, grad_accum_steps=2),
    )
    trainer.train(1)
    with tf.GradientTape() as tape:
        logits = reference(x, training=True)
        mask = tf.cast(x != 0, tf.float32)
        loss = tf.reduce_sum(per_token(y, logits) * mask) / tf.reduce_sum(mask)
    gradients = [tf.convert_to_tensor(g) for g in tape.gradient(loss, reference.trainable_variables)]
    assert tf.linalg.global_norm(gradients) > 0.05  # The clip matters.
    clipped, _ = tf.clip_by_global_norm(gradients, 0.05)
    for variable, gradient, trained in zip(
        reference.trainable_variables, clipped, model.trainable_variables, strict=True
    ):
        np.testing.assert_allclose(
            trained.numpy(), variable.numpy() - 0.5 * gradient.numpy(), rtol=1e-5, atol=1e-7
        )


def test_per_token_sample_weights_with_a_mask_equal_keras_fit(mirrored):
    """(B, T) sample weights and the padding mask together, on two replicas, equal fit on one
    (which is what fit gives whenever every replica holds as many real tokens: one replica)."""
    x, y, weights = token_data(2 * BATCH)
    keras_model, _ = embedding_model(engine.build_strategy("default"))
    keras_model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    keras_model.fit(
        tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH), epochs=1, verbose=0, shuffle=False
    )
    model, optimizer = embedding_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH),
        global_batch_size=BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
    )
    trainer.train(2)
    for trained, expected in zip(model.weights, keras_model.weights, strict=True):
        np.testing.assert_allclose(trained.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def batch_norm_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(3),
            ]
        )
        optimizer = keras.optimizers.SGD(0.1)
    return model, optimizer


def test_the_reported_evaluation_is_what_the_saved_checkpoint_gives(mirrored, tmp_path):
    """BatchNormalization's moving statistics, which each replica updates from its own batch,
    are one value when the run evaluates and saves: a restore of the checkpoint evaluates to
    the very numbers the run reported."""
    x, y = make_arrays(64)
    eval_data = tf.data.Dataset.from_tensor_slices((x[:17], y[:17])).batch(8)

    def trainer_of(model, optimizer):
        return make_trainer(
            mirrored,
            arrays=(x, (x[:, 1] > 0.5).astype("int32")),
            batch=8,
            model=model,
            optimizer=optimizer,
            eval_data=eval_data,
            cadence=engine.Cadence(steps_per_loop=3),
            model_dir=str(tmp_path),
        )

    trainer = trainer_of(*batch_norm_model(mirrored))
    trainer.train(6)
    reported = trainer.evaluate()
    trainer.close()
    moving_mean = trainer.model.layers[1].moving_mean.value
    first, second = mirrored.experimental_local_results(moving_mean)
    np.testing.assert_array_equal(first.numpy(), second.numpy())  # One value on every replica.
    restored = trainer_of(*batch_norm_model(mirrored))
    assert restored.step == 6
    assert restored.evaluate() == reported


METRIC_NAMES = {
    objectives.CLASSES: ("accuracy", "top_5_accuracy"),
    objectives.MULTI_LABEL: ("accuracy", "auc", "precision", "recall"),
    objectives.VALUES: ("mae", "mse", "rmse", "r2"),
}


@pytest.mark.parametrize("kind", sorted(METRIC_NAMES))
def test_every_metric_name_trains_and_evaluates_on_two_replicas(mirrored, kind):
    """What --metrics names build (R2Score and AUC(multi_label) make their variables lazily,
    which failed inside a step on two replicas), trained and evaluated with a partial batch."""
    x, _ = make_arrays(36)
    width = {objectives.CLASSES: 6, objectives.MULTI_LABEL: 2, objectives.VALUES: 2}[kind]
    labels = {
        objectives.CLASSES: (x[:, 0] * 6).astype("int32"),
        objectives.MULTI_LABEL: (x[:, :2] > 0.5).astype("float32"),
        objectives.VALUES: x[:, :2] * 3.0,
    }[kind]
    with mirrored.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(width)])
        optimizer = keras.optimizers.SGD(0.1)
    names = METRIC_NAMES[kind]
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, labels)).repeat().batch(8),
        eval_data=tf.data.Dataset.from_tensor_slices((x[:13], labels[:13])).batch(8),
        global_batch_size=8,
        loss_fn=objectives.PerExampleLoss(objectives.DEFAULT_LOSSES[kind], width),
        metrics=[objectives.build_metric(name, kind, width) for name in names],
    )
    logs = trainer.train(3)
    results = trainer.evaluate()
    assert results["num_examples"] == 13
    for name in names:
        assert np.isfinite(logs[name]) and np.isfinite(results[name]), name


class NeedsArguments(keras.metrics.Metric):
    """A user's metric with an __init__ argument and no get_config."""

    def __init__(self, scale):
        super().__init__(name="scaled")
        self.scale = scale
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(self.scale * keras.ops.sum(y_pred))

    def result(self):
        return self.total


def test_a_metric_that_cannot_be_copied_and_an_optimizer_outside_the_scope_are_one_line(mirrored):
    x, y = make_arrays(16)
    model, optimizer = make_model(mirrored)
    common = dict(
        strategy=mirrored,
        model=model,
        train_data=global_batches(x, y, 8),
        global_batch_size=8,
        loss_fn=loss_fn(),
    )
    with pytest.raises(
        engine.UserError, match=r"metric 'scaled' \(NeedsArguments\) cannot be remade.*get_config"
    ) as raised:
        make_trainer(optimizer=optimizer, metrics=[NeedsArguments(2.0)], **common)
    assert "\n" not in str(raised.value)
    outside = keras.optimizers.Adam()  # Made in the default strategy's scope, not the mirrored one's.
    with pytest.raises(
        engine.UserError, match=r"optimizer 'optimizer' \(Adam\) was created outside strategy.scope"
    ):
        make_trainer(optimizer=outside, **common)


def test_a_partial_last_batch_counts_the_examples_it_holds_in_examples_per_second(default):
    """The loop of a finite dataset's last batch (3 of 8 examples) reports 3 examples' speed."""
    x, y = make_arrays(11)
    model, optimizer = make_model(default)
    seen: list = []
    trainer = make_trainer(
        default,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
        global_batch_size=8,
        cadence=engine.Cadence(steps_per_loop=1),
        callbacks=[lambda trainer, step, logs: seen.append(logs)],
    )
    with pytest.raises(engine.DataExhaustedError):
        trainer.train(3)
    full, partial = seen
    assert full["examples_per_second"] == pytest.approx(8 * full["steps_per_second"], rel=1e-6)
    assert partial["examples_per_second"] == pytest.approx(3 * partial["steps_per_second"], rel=1e-6)


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_xla_with_masked_outputs_counts_the_tokens_outside_the_compiled_pass(mirrored):
    """The token count's all-reduce cannot run inside XLA: under jit_compile it is taken before
    the compiled pass, and the update equals the one without XLA."""
    x, y, _ = token_data(4 * BATCH, seed=3)

    def weights_after(jit_compile: bool) -> list[np.ndarray]:
        model, optimizer = embedding_model(mirrored)
        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
            global_batch_size=BATCH,
            loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
            step=engine.StepOptions(grad_accum_steps=2, jit_compile=jit_compile),
        )
        trainer.train(4)
        return [w.numpy() for w in model.weights]

    for compiled, plain in zip(weights_after(True), weights_after(False), strict=True):
        np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-7)


def test_losses_nested_unlike_the_outputs_or_reduced_to_one_number_are_one_line():
    """engine.losses refuses, naming both structures, what would otherwise pair a loss with the
    wrong output or average an average."""
    from engine.losses import Objective

    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with pytest.raises(engine.UserError, match=r"loss_weights=\[1.0\] must be nested like loss_fn \(a dict"):
        Objective({"a": sce, "b": sce}, [1.0])
    with pytest.raises(engine.UserError, match="must be finite and not negative"):
        Objective([sce, sce], [1.0, float("nan")])
    with pytest.raises(engine.UserError, match=r"reduces the batch to one number"):
        Objective(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels, logits = tf.constant([0, 1]), tf.zeros((2, 3))
    with pytest.raises(
        engine.UserError, match=r"the outputs \(one tensor\) are not nested like loss_fn \(a dict"
    ):
        Objective({"a": sce, "b": sce}).terms({"a": labels, "b": labels}, logits)
    with pytest.raises(engine.UserError, match="returned one number for the batch"):
        Objective(lambda y, p: tf.reduce_mean(sce(y, p))).terms(labels, logits)
