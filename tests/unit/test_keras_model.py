"""engine.keras_model: what a Keras user hands over besides the layers is honoured as `fit`,
`evaluate` and `predict` honour it, or refused in one line (issue 47).

Each case builds the same model twice from the same weights, trains one with Keras and one
with the engine under the same strategy, and compares every weight and the reported logs.
A model's own train_step / test_step / predict_step is the user's arithmetic: the engine is
compared with Keras under the same strategy. An overridden compute_loss is the standard
step's loss, where the engine's rule holds: what the override adds counts once per step,
so two replicas train as one (Keras counts it once per replica).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from helpers import make_trainer

import engine

BATCH, TRAIN_STEPS = 16, 4
RTOL, ATOL = 1e-5, 1e-6


def strategy_of(replicas: int) -> tf.distribute.Strategy:
    return engine.build_strategy("mirrored" if replicas > 1 else "default", cpu_devices=2)


def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n).astype("int32")


TRAIN = arrays(BATCH * TRAIN_STEPS, 0)
EVAL = arrays(2 * BATCH + 5, 1)  # A partial last batch: split 3/2 over two replicas.


def batches(data: tuple, batch: int = BATCH) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(data).batch(batch)


def train_batches(batch: int = BATCH) -> tf.data.Dataset:
    """Full batches only (a static batch size): on two replicas a batch that may be partial runs
    in a call of its own (engine.loop.variable_length), and the logs are the last call's."""
    return tf.data.Dataset.from_tensor_slices(TRAIN).batch(batch, drop_remainder=True)


class OwnStep(keras.Model):
    """A research model with its own train_step: a weight penalty added by hand, its metrics
    updated and returned the way Keras's guide writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.logits(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            predictions = self(x, training=True)
            loss = self.compute_loss(x, y, predictions) + 0.01 * tf.reduce_sum(tf.square(self.logits.kernel))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, predictions)
        return {metric.name: metric.result() for metric in self.metrics}


class OwnLossAndEval(keras.Model):
    """compute_loss with a penalty, test_step with test-time augmentation (the mean of x and
    -x), predict_step returning probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.logits(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.05 * tf.reduce_sum(tf.square(self.logits.kernel))

    def test_step(self, data):
        x, y = data
        predictions = (self(x) + self(-x)) / 2.0
        loss = self.compute_loss(x, y, predictions, training=False)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss, sample_weight=tf.shape(x)[0])
            else:
                metric.update_state(y, predictions)
        return self.get_metrics_result()

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return tf.nn.softmax(self(x))


def build(cls: type, strategy: tf.distribute.Strategy, **compile_args) -> keras.Model:
    """`cls` with fixed weights, compiled in `strategy`'s scope (SGD, the logits' loss, accuracy)."""
    with strategy.scope():
        model = cls()
        model(TRAIN[0][:1])
        model.set_weights([np.full_like(w, 0.1) * (i + 1) for i, w in enumerate(model.get_weights())])
        settings = {
            "optimizer": keras.optimizers.SGD(0.1),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": ["accuracy"],
            **compile_args,
        }
        model.compile(**settings)
    return model


@functools.cache
def fit_of(cls: type, replicas: int) -> tuple[list[np.ndarray], dict[str, float]]:
    model = build(cls, strategy_of(replicas))
    history = model.fit(train_batches(), epochs=1, verbose=0, shuffle=False)
    return model.get_weights(), {name: values[-1] for name, values in history.history.items()}


@functools.cache
def engine_of(cls: type, replicas: int) -> tuple[engine.Trainer, dict[str, float]]:
    """The engine given the compiled model alone: no optimizer, loss or metrics of its own."""
    strategy = strategy_of(replicas)
    model = build(cls, strategy)
    trainer = make_trainer(
        strategy,
        model=model,
        train_data=train_batches(),
        eval_data=batches(EVAL),
        global_batch_size=BATCH,
        cadence=engine.Cadence(steps_per_loop=TRAIN_STEPS),
        loss_fn=None,
    )
    return trainer, trainer.train(TRAIN_STEPS)


def assert_weights_equal(actual: list, expected: list) -> None:
    for index, (a, b) in enumerate(zip(actual, expected, strict=True)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"weight {index}")


def replica_params():
    return [pytest.param(1, id="1"), pytest.param(2, id="2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("replicas", replica_params())
def test_a_models_own_train_step_trains_and_reports_as_fit(replicas):
    """Before: the override was ignored (0.079-0.132 from fit in weights, no word)."""
    fit_weights, fit_logs = fit_of(OwnStep, replicas)
    trainer, logs = engine_of(OwnStep, replicas)
    assert_weights_equal(trainer.model.get_weights(), fit_weights)
    assert logs["loss"] == pytest.approx(fit_logs["loss"], rel=RTOL)
    assert logs["accuracy"] == pytest.approx(fit_logs["accuracy"], rel=RTOL)


def test_an_overridden_compute_loss_is_the_loss_on_one_replica_as_in_fit():
    fit_weights, fit_logs = fit_of(OwnLossAndEval, 1)
    trainer, logs = engine_of(OwnLossAndEval, 1)
    assert_weights_equal(trainer.model.get_weights(), fit_weights)
    assert logs["loss"] == pytest.approx(fit_logs["loss"], rel=RTOL)


@pytest.mark.slow
def test_an_overridden_compute_loss_trains_two_replicas_as_one():
    """The penalty counts once per step, not once per replica as in fit (which would differ)."""
    one, one_logs = engine_of(OwnLossAndEval, 1)
    two, two_logs = engine_of(OwnLossAndEval, 2)
    assert_weights_equal(two.model.get_weights(), one.model.get_weights())
    assert two_logs["loss"] == pytest.approx(one_logs["loss"], rel=RTOL)
    fit_two, _ = fit_of(OwnLossAndEval, 2)
    apart = [float(np.max(np.abs(a - b))) for a, b in zip(fit_two, one.model.get_weights(), strict=True)]
    assert max(apart) > 1e-3


@pytest.mark.parametrize("replicas", replica_params())
def test_a_models_own_test_step_and_predict_step_are_evaluate_and_predict(replicas):
    """Keras under the same strategy, holding the engine's weights, is the reference: the steps
    are the user's arithmetic (Keras's own loss inside them is scaled per replica)."""
    trainer, _ = engine_of(OwnLossAndEval, replicas)
    reference = build(OwnLossAndEval, strategy_of(replicas))
    reference.set_weights(trainer.model.get_weights())
    expected = reference.evaluate(batches(EVAL), verbose=0, return_dict=True)
    logs = trainer.evaluate()
    assert logs["num_examples"] == len(EVAL[0])
    assert logs["accuracy"] == pytest.approx(expected["accuracy"], rel=RTOL)
    assert logs["loss"] == pytest.approx(expected["loss"], rel=RTOL)
    predicted = trainer.predict(EVAL[0])
    np.testing.assert_allclose(predicted, reference.predict(EVAL[0], batch_size=BATCH, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(predicted.sum(axis=1), 1.0, rtol=1e-5)  # Its predict_step's probabilities.


@pytest.mark.parametrize("replicas", replica_params())
def test_a_compiled_multi_output_model_trains_with_its_loss_weights(replicas):
    """Before: refused without loss_fn, and with one its loss_weights were silently dropped.
    Each output's loss is reported under Keras's name."""
    strategy = strategy_of(replicas)

    def model() -> keras.Model:
        with strategy.scope():
            inputs = keras.Input((5,))
            hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
            outputs = {
                "kind": keras.layers.Dense(3, name="kind")(hidden),
                "size": keras.layers.Dense(1, name="size")(hidden),
            }
            built = keras.Model(inputs, outputs)
            built.set_weights([np.full_like(w, 0.05) * (i + 1) for i, w in enumerate(built.get_weights())])
            built.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
                loss_weights={"kind": 1.0, "size": 0.25},
            )
        return built

    x, y = TRAIN
    labels = {"kind": y, "size": x[:, :1] * 2.0}
    data = tf.data.Dataset.from_tensor_slices((x, labels)).batch(BATCH)
    keras_model = model()
    keras_model.fit(data, epochs=1, verbose=0, shuffle=False)
    trainer = make_trainer(
        strategy,
        model=model(),
        train_data=data,
        eval_data=data,
        global_batch_size=BATCH,
        cadence=engine.Cadence(steps_per_loop=TRAIN_STEPS),
        loss_fn=None,
    )
    trainer.train(TRAIN_STEPS)
    assert_weights_equal(trainer.model.get_weights(), keras_model.get_weights())
    # One batch holding every example: Keras's per-output means are then exact too.
    expected = keras_model.evaluate(x, labels, batch_size=len(x), verbose=0, return_dict=True)
    logs = trainer.evaluate()
    for key in ("loss", "kind_loss", "size_loss"):
        assert logs[key] == pytest.approx(expected[key], rel=RTOL), key


def test_metric_names_a_reducing_loss_and_numpy_arrays_are_taken_as_compile_and_fit_take_them():
    """Before: each refused, one per run (metric names, a Keras loss with its default
    reduction, numpy arrays as train_data)."""
    strategy = strategy_of(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        reference = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        reference.set_weights(model.get_weights())
        reference.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=keras.optimizers.SGD(0.1),
        train_data=TRAIN,
        eval_data=(pd.DataFrame(EVAL[0]), pd.Series(EVAL[1])),
        global_batch_size=BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    assert isinstance(trainer.eval_metrics[0], keras.metrics.SparseCategoricalAccuracy)
    trainer.train(TRAIN_STEPS)
    logs = trainer.evaluate()
    reference.set_weights(model.get_weights())
    expected = reference.evaluate(*EVAL, batch_size=BATCH, verbose=0, return_dict=True)
    assert logs["num_examples"] == len(EVAL[0])
    assert logs["loss"] == pytest.approx(expected["loss"], rel=RTOL)
    assert logs["accuracy"] == pytest.approx(expected["accuracy"], rel=RTOL)


def test_a_models_own_train_step_reads_a_function_of_the_input_context(default):
    """The compiled state is made from the pipeline's spec (the function is called once for it)."""

    def per_replica(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return train_batches(context.get_per_replica_batch_size(BATCH))

    model = build(OwnStep, default)
    trainer = make_trainer(
        default,
        model=model,
        train_data=per_replica,
        global_batch_size=BATCH,
        cadence=engine.Cadence(steps_per_loop=TRAIN_STEPS),
        loss_fn=None,
    )
    trainer.train(TRAIN_STEPS)
    fit_weights, _ = fit_of(OwnStep, 1)
    assert_weights_equal(model.get_weights(), fit_weights)


def test_a_model_with_its_own_train_step_resumes_bitwise(tmp_path):
    """Its optimizer is the compiled one, checkpointed with the model; the metrics restart."""
    strategy = strategy_of(1)

    def trainer(model_dir) -> engine.Trainer:
        return make_trainer(
            strategy,
            model=build(OwnStep, strategy),
            train_data=train_batches().repeat(),
            global_batch_size=BATCH,
            model_dir=str(model_dir),
            cadence=engine.Cadence(steps_per_loop=2),
            loss_fn=None,
        )

    whole = trainer(tmp_path / "whole")
    whole.train(6)
    first = trainer(tmp_path / "resumed")
    first.train(3)
    first.close()
    resumed = trainer(tmp_path / "resumed")
    assert resumed.step == 3
    resumed.train(6)
    for a, b in zip(resumed.model.get_weights(), whole.model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_what_conflicts_with_the_model_is_refused_in_one_line():
    strategy = strategy_of(1)
    data = batches(TRAIN)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    cases = [
        (
            dict(model=build(OwnStep, strategy), step_fn=lambda batch: {}),
            "OwnStep overrides train_step, which is its step; drop step_fn",
        ),
        (
            dict(model=build(OwnLossAndEval, strategy), loss_fn=sce),
            "OwnLossAndEval overrides compute_loss, which is its loss: drop loss_fn",
        ),
        (
            dict(model=build(OwnStep, strategy), optimizer=keras.optimizers.Adam()),
            r"OwnStep.train_step applies self.optimizer \(SGD\), not the Trainer's optimizer \(Adam\)",
        ),
        (
            dict(model=build(OwnStep, strategy), metrics=["mae"]),
            "the model was compiled with metrics= and the Trainer was given metrics too",
        ),
        (
            dict(model=build(OwnLossAndEval, strategy, metrics=None), loss_weights=[1.0]),
            "the model was compiled with a loss and the Trainer was given loss_weights too",
        ),
    ]
    with strategy.scope():
        plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        uncompiled = OwnStep()
        uncompiled(TRAIN[0][:1])
    cases.append((dict(model=uncompiled, optimizer=keras.optimizers.SGD()), "compile\\(\\) it first"))
    cases.append((dict(model=plain, loss_fn=sce), "pass optimizer= to the Trainer, or compile"))
    cases.append(
        (
            dict(model=plain, loss_fn=sce, optimizer=keras.optimizers.SGD(), metrics=["nonsense"]),
            "is not a Keras metric",
        )
    )
    for arguments, message in cases:
        with pytest.raises(engine.UserError, match=message) as raised:
            make_trainer(strategy, train_data=data, global_batch_size=BATCH, **{"loss_fn": None, **arguments})
        assert "\n" not in str(raised.value)
