"""The numbers a Keras user would get, on every data form (issue 18).

Each case as a research user writes it from the README, checked against an
independent reference: Keras `fit` / `evaluate`, a plain TF loop, numpy, or
the same run without an interruption.

Covers: engine/data.py.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_FEATURES, loss_fn, make_arrays, make_model, make_trainer

import engine
from engine.data import GlobalBatches, PerReplicaBatches, as_train_form, pipeline_at, steps_to_elements
from engine.variables import regularization_losses

GLOBAL_BATCH = 8


def weights_of(model):
    return [np.array(tf.convert_to_tensor(v)) for v in engine.variables.all_variables(model)]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


# ------------------------------------------------------- data forms, resume


def ids_dataset(n: int) -> tf.data.Dataset:
    """Examples whose features carry their id, so a replayed batch changes the weights."""
    x, y = make_arrays(n)
    x[:, -1] = np.arange(n, dtype="float32") / n
    return tf.data.Dataset.from_tensor_slices((x, y))


def per_replica_fn(input_context):
    batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
    ds = ids_dataset(400).shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.repeat().batch(batch, drop_remainder=True)


def per_replica_from_step(input_context, start_step):
    return per_replica_fn(input_context).skip(steps_to_elements(input_context, start_step))


def train_with(strategy, data, model_dir, steps, *, seed=3):
    model, optimizer = make_model(strategy, seed=seed)
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=data,
        global_batch_size=GLOBAL_BATCH,
        cadence=engine.Cadence(steps_per_loop=3),
        model_dir=model_dir,
    )
    trainer.train(steps)
    return model, trainer


@pytest.mark.parametrize(
    "data",
    [
        per_replica_fn,
        pytest.param(per_replica_from_step, marks=pytest.mark.slow),  # The fast tier: one fn form, one Dataset.
        pytest.param(PerReplicaBatches(fn=per_replica_fn), marks=pytest.mark.slow),
        ids_dataset(400).repeat().batch(GLOBAL_BATCH, drop_remainder=True),
    ],
    ids=["fn(input_context)", "fn(input_context, start_step)", "PerReplicaBatches(fn=)", "Dataset"],
)
def test_every_data_form_resumes_bitwise_on_two_replicas_from_one_pipeline(mirrored, tmp_path, data):
    whole, _ = train_with(mirrored, data, None, 9)
    train_with(mirrored, data, str(tmp_path), 4)  # "Crashes" after step 4 (saved there) ...
    resumed, trainer = train_with(mirrored, data, str(tmp_path), 9)  # ... and is run again.
    assert trainer.step == 9
    assert_bitwise(weights_of(whole), weights_of(resumed))


def test_each_pipeline_skips_its_share_of_the_steps():
    """Two pipelines feeding four replicas: a step takes two elements of each pipeline."""
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    form = as_train_form(lambda input_context: tf.data.Dataset.range(100))
    assert steps_to_elements(context, 5) == 10
    assert int(next(iter(pipeline_at(form, context, start_step=5)))) == 10
    one_each = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=2)
    assert int(next(iter(pipeline_at(form, one_each, start_step=5)))) == 5


def test_a_global_batch_function_declared_by_its_form_gets_the_step():
    seen = []

    def global_from(step):  # A name as_train_form cannot read: declared instead.
        seen.append(step)
        return tf.data.Dataset.range(100).skip(step)

    with pytest.raises(engine.UserError, match=r"cannot tell its data form.*GlobalBatches\(from_step=f\)"):
        as_train_form(lambda step: tf.data.Dataset.range(100))
    form = GlobalBatches(from_step=global_from)
    assert int(next(iter(pipeline_at(form, tf.distribute.InputContext(), start_step=7)))) == 7
    assert seen == [7]
    with pytest.raises(engine.UserError, match="exactly one"):
        PerReplicaBatches()


# ------------------------------------------------------- regularization


class Holder(tf.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def __call__(self, x, training=False):
        return self.net(x, training=training)


class KerasAroundModule(keras.Model):
    """A Keras model holding a tf.Module holding an L2 Dense (Keras cannot see it)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = Holder(inner)

    def call(self, x, training=False):
        return self.inner(x, training=training)


def train_eight_steps(strategy, model, optimizer) -> None:
    x, y = make_arrays(64)
    make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH, drop_remainder=True),
        global_batch_size=GLOBAL_BATCH,
        cadence=engine.Cadence(steps_per_loop=4),
    ).train(8)


@functools.cache
def l2_model_alone() -> tuple[np.ndarray, ...]:
    """The L2 model's weights after `train_eight_steps` on two replicas, not wrapped: the
    reference of every wrapping, trained once per process (read-only)."""
    strategy = engine.build_strategy("mirrored", cpu_devices=2)
    direct, optimizer = make_model(strategy, l2=0.5)
    train_eight_steps(strategy, direct, optimizer)
    weights = direct.get_weights()
    for weight in weights:
        weight.flags.writeable = False
    return tuple(weights)


@pytest.mark.parametrize("wrap", ["module", pytest.param("keras_around_module", marks=pytest.mark.slow)])
def test_regularizers_behind_a_tf_module_train_as_the_model_alone(mirrored, wrap):
    direct = l2_model_alone()
    inner, optimizer = make_model(mirrored, l2=0.5)
    with mirrored.scope():
        wrapped = Holder(inner) if wrap == "module" else KerasAroundModule(inner)
    assert len(regularization_losses(wrapped)) == 1
    train_eight_steps(mirrored, wrapped, optimizer)
    for a, b in zip(direct, inner.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(direct[0], make_model(mirrored, l2=0.5)[0].get_weights()[0])


def test_a_shared_layer_counts_its_penalty_once():
    net = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(1.0))]
    )
    module = Holder(net)
    module.dense = net.layers[0]  # The same layer reached twice.
    expected = float(tf.reduce_sum(net.layers[0].kernel ** 2))
    assert float(tf.add_n(regularization_losses(module))) == pytest.approx(expected, rel=1e-6)


def test_a_regularized_variable_no_layer_reports_is_refused(mirrored):
    with mirrored.scope():
        layer = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(1.0))
        layer.build((None, NUM_FEATURES))

        class Loose(tf.Module):
            def __init__(self):
                super().__init__()
                self.kernel = layer.kernel  # The layer itself is not kept.

            def __call__(self, x):
                return x @ self.kernel

        model = Loose()
        optimizer = keras.optimizers.SGD(0.1)
    x, y = make_arrays(16)
    with pytest.raises(engine.UserError, match="has a regularizer that no Keras layer of the model reports"):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8),
            global_batch_size=8,
        )


# ------------------------------------------------------- evaluation as Keras


def test_evaluate_equals_keras_evaluate_with_l2_and_sample_weights(mirrored):
    x, y = make_arrays(101, seed=5)
    w = np.random.RandomState(1).uniform(0.0, 2.0, 101).astype("float32")
    model, optimizer = make_model(mirrored, l2=0.1)
    trainer = make_trainer(
        strategy=mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH, drop_remainder=True),
        eval_data=tf.data.Dataset.from_tensor_slices((x, y, w)).batch(16),  # The last batch holds 5.
        global_batch_size=GLOBAL_BATCH,
        loss_fn=loss_fn(),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")],
    )
    ours = trainer.evaluate()

    reference, _ = make_model(engine.build_strategy("default"), l2=0.1)
    reference.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")],
    )
    theirs = reference.evaluate(x, y, sample_weight=w, batch_size=16, verbose=0, return_dict=True)
    assert ours["num_examples"] == 101
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
    assert ours["weighted_accuracy"] == pytest.approx(theirs["weighted_accuracy"], abs=1e-6)
    assert ours["accuracy"] != pytest.approx(ours["weighted_accuracy"], abs=1e-3)  # The two really differ.
    # By hand: sum(w * l) / N + the L2 penalty, over every example.
    logits = reference(x)
    by_hand = float(tf.reduce_sum(w * loss_fn()(y, logits))) / 101 + float(tf.add_n(reference.losses))
    assert ours["loss"] == pytest.approx(by_hand, rel=1e-5)


def test_keras_callbacks_take_the_decisions_they_take_under_fit_on_an_l2_model(default):
    """EarlyStopping and ReduceLROnPlateau on val_loss: the same epochs as under fit."""
    x, y = make_arrays(96, seed=2)
    xv, _ = make_arrays(40, seed=9)
    yv = np.random.RandomState(9).randint(0, 3, 40).astype("int32")  # Unlearnable: val_loss turns up.
    steps_per_epoch = 96 // 16

    def callbacks():
        return [
            keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=1, min_delta=0.0),
            keras.callbacks.EarlyStopping("val_loss", patience=3),
        ]

    fit_model, _ = make_model(default, l2=0.05)
    fit_model.compile(optimizer=keras.optimizers.SGD(2.0), loss=keras.losses.SparseCategoricalCrossentropy(True))
    fit_callbacks = callbacks()
    history = fit_model.fit(
        x,
        y,
        batch_size=16,
        epochs=40,
        shuffle=False,
        validation_data=(xv, yv),
        callbacks=fit_callbacks,
        verbose=0,
    )

    model, _ = make_model(default, l2=0.05)
    with default.scope():
        optimizer = keras.optimizers.SGD(2.0)
    ours = callbacks()
    trainer = make_trainer(
        default,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16),
        eval_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(16),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_epoch=steps_per_epoch, eval_every=steps_per_epoch),
        callbacks=ours,
    )
    trainer.train(40 * steps_per_epoch)
    epochs_run = trainer.step // steps_per_epoch
    assert epochs_run == len(history.history["val_loss"]) < 40
    assert ours[1].stopped_epoch == fit_callbacks[1].stopped_epoch
    np.testing.assert_allclose(
        float(tf.convert_to_tensor(optimizer.learning_rate)),
        float(tf.convert_to_tensor(fit_model.optimizer.learning_rate)),
        rtol=1e-6,
    )
    assert trainer.last_eval[1]["loss"] == pytest.approx(history.history["val_loss"][-1], rel=1e-4)


def test_duplicate_metric_names_are_refused(mirrored):
    model, optimizer = make_model(mirrored)
    x, y = make_arrays(16)
    with pytest.raises(engine.UserError, match=r"'accuracy' used twice"):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8),
            global_batch_size=8,
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        )


# ------------------------------------------------------- partial batches


@functools.cache
def fit_of_finite_data(examples: int) -> tuple[np.ndarray, ...]:
    """The weights of one epoch of Keras fit on `examples` in batches of 32, on one device: the
    reference of every loop length, fitted once per process (read-only)."""
    x, y = make_arrays(examples, seed=4)
    reference, _ = make_model(engine.build_strategy("default"))
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(True))
    reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    weights = reference.get_weights()
    for weight in weights:
        weight.flags.writeable = False
    return tuple(weights)


@pytest.mark.parametrize(
    "examples, steps_per_loop",
    [  # 193: the last batch holds 1, one replica none. The fast tier: a loop length that cuts the last loop.
        *[pytest.param(200, spl, marks=pytest.mark.slow) for spl in (1, 6, 50)],
        (200, 3),
        (193, 3),
    ],
)
def test_a_partial_last_batch_trains_as_fit_for_any_loop_length(mirrored, tmp_path, examples, steps_per_loop):
    x, y = make_arrays(examples, seed=4)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # 6 batches of 32 and one of 8 (or 1).
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=finite,
        global_batch_size=32,
        cadence=engine.Cadence(steps_per_loop=steps_per_loop),
        model_dir=str(tmp_path),
    )
    with pytest.raises(engine.DataExhaustedError, match="ran out after step 7 of 100"):
        trainer.train(100)
    assert trainer.step == 7 == int(optimizer.iterations.numpy())
    assert trainer.checkpoint_manager.latest_checkpoint.endswith("ckpt-7")
    for a, b in zip(model.get_weights(), fit_of_finite_data(examples), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_loss_of_a_loop_with_a_partial_batch_is_fits_example_weighted_epoch_loss(mirrored, replicas):
    """fit's loss tracker weighs each batch by its size: the last batch of 8 weighs a quarter of a
    full one (a mean of the step losses reported 1.967 where fit reported 1.280)."""
    x, y = make_arrays(200, seed=4)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # 6 batches of 32 and one of 8.
    reference, _ = make_model(engine.build_strategy("default"), l2=0.01)
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(True))
    fit_loss = reference.fit(finite, epochs=1, verbose=0).history["loss"][-1]

    strategy = mirrored if replicas > 1 else engine.build_strategy("default")
    model, optimizer = make_model(strategy, l2=0.01)
    trainer = make_trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=finite,
        global_batch_size=32,
        loss_fn=loss_fn(),
        cadence=engine.Cadence(steps_per_loop=7),  # One loop, the whole epoch.
    )
    logs = trainer.train(7)
    assert trainer.step == 7
    np.testing.assert_allclose(logs["loss"], fit_loss, rtol=1e-6, atol=1e-6)


def test_a_partial_batch_splits_over_accumulation_steps_as_the_whole_batch(mirrored):
    x, y = make_arrays(40, seed=6)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 16, 16, 8.
    results = []
    for accumulation in (1, 4):
        model, optimizer = make_model(mirrored)
        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=finite,
            global_batch_size=16,
            step=engine.StepOptions(grad_accum_steps=accumulation),
        )
        with pytest.raises(engine.DataExhaustedError):
            trainer.train(10)
        assert trainer.step == 3
        results.append(model.get_weights())
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_first_batch_of_the_wrong_size_is_still_refused_after_a_resume(mirrored, tmp_path):
    x, y = make_arrays(320)
    model, optimizer = make_model(mirrored)
    common = dict(strategy=mirrored, global_batch_size=16, loss_fn=loss_fn(), model_dir=str(tmp_path))
    make_trainer(
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16),
        **common,
    ).train(3)
    model, optimizer = make_model(mirrored)
    too_large = make_trainer(
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32),
        **common,
    )
    assert too_large.step == 3
    with pytest.raises(
        engine.UserError, match="first batch holds 32 examples.*no update was applied after step 3"
    ):
        too_large.train(6)
    assert too_large.step == 3


# ------------------------------------------------------- non-finite gradients


@tf.custom_gradient
def nan_gradient_where(value, marked):
    """`value` forward; a NaN gradient where `marked` (a backward pass that breaks, such as
    sqrt's at 0, while the forward pass stays finite)."""

    def backward(upstream):
        return tf.where(marked, tf.constant(np.nan, upstream.dtype), upstream), None

    return tf.identity(value), backward


class SqrtProbe(tf.Module):
    """A research model whose batch gets a finite loss and a NaN gradient where x[:, 0] < 0."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.scale = tf.Variable(1.0, name="scale")

    @tf.autograph.experimental.do_not_convert  # Plain graph code; AutoGraph mis-binds custom gradients here.
    def __call__(self, x, training=False):
        scale = nan_gradient_where(tf.identity(self.scale), tf.reduce_any(x[:, 0] < 0))
        return self.net(x, training=training) * scale


def probe_model(strategy):
    net, _ = make_model(strategy)
    with strategy.scope():
        return SqrtProbe(net), keras.optimizers.SGD(0.5)


def nan_gradient_data():
    """Batch 3 (of 8 examples) holds one example whose gradient is NaN while its loss is finite."""
    x, y = make_arrays(64, seed=8)
    x[3 * 8 + 2, 0] = -1.0
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)


def test_a_nan_gradient_with_a_finite_loss_is_skipped_and_counted(mirrored):
    x, y, data = nan_gradient_data()
    model, _ = probe_model(mirrored)
    with tf.GradientTape() as tape:  # The premise, by hand.
        loss = tf.reduce_mean(loss_fn()(y[24:32], model(x[24:32])))
    assert np.isfinite(float(loss))
    assert not all(
        np.isfinite(g.numpy()).all() for g in tape.gradient(loss, engine.variables.trainable_variables(model))
    )

    model, optimizer = probe_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=data,
        global_batch_size=8,
        cadence=engine.Cadence(steps_per_loop=6),
        step=engine.StepOptions(on_nonfinite="skip"),
    )
    logs = trainer.train(6)
    assert logs["nonfinite_steps"] == 1
    assert trainer.step == 6 == int(optimizer.iterations.numpy()) + 1
    assert all(np.isfinite(w).all() for w in weights_of(model))
    # Equal to training on the other five batches only.
    skipped, skipped_optimizer = probe_model(mirrored)
    kept = [i for i in range(6) if i != 3]
    make_trainer(
        mirrored,
        model=skipped,
        optimizer=skipped_optimizer,
        train_data=tf.data.Dataset.from_tensor_slices(
            (
                np.concatenate([x[i * 8 : i * 8 + 8] for i in kept]),
                np.concatenate([y[i * 8 : i * 8 + 8] for i in kept]),
            )
        ).batch(8),
        global_batch_size=8,
        cadence=engine.Cadence(steps_per_loop=5),
    ).train(5)
    assert_bitwise(weights_of(model), weights_of(skipped))


def test_a_nan_gradient_with_a_finite_loss_stops_the_run_without_saving(mirrored, tmp_path):
    _, _, data = nan_gradient_data()
    model, optimizer = probe_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=data,
        global_batch_size=8,
        cadence=engine.Cadence(steps_per_loop=2, checkpoint_every=2),
        model_dir=str(tmp_path),
    )
    stopped = r"at step 4 \(loss [0-9.]+\);.*latest checkpoint .*ckpt-2"
    with pytest.raises(engine.NonFiniteLossError, match=stopped):
        trainer.train(30)
    reader = tf.train.load_checkpoint(trainer.checkpoint_manager.latest_checkpoint)
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == 2


# ------------------------------------------------------- Keras callbacks


def test_early_stopping_restores_the_best_weights_of_a_tf_module(default):
    x, y = make_arrays(64, seed=3)
    net, _ = make_model(default)
    with default.scope():
        model = Holder(net)
        optimizer = keras.optimizers.SGD(3.0)  # Large enough to overshoot: val_loss rises again.
    best_weights = {}

    class RecordBest(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            best_weights[epoch] = (logs["val_loss"], [w.copy() for w in self.model.get_weights()])

    stopping = keras.callbacks.EarlyStopping("val_loss", patience=2, restore_best_weights=True)
    trainer = make_trainer(
        default,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16),
        eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_epoch=4, eval_every=4),
        callbacks=[RecordBest(), stopping],
    )
    trainer.train(4 * 30)
    assert stopping.stopped_epoch > 0
    best_loss, expected = min(best_weights.values(), key=lambda entry: entry[0])
    assert_bitwise(weights_of(model), expected)


def test_learning_rate_callbacks_with_several_optimizers_are_refused_at_construction(mirrored):
    from engine.hooks import ReduceLROnPlateau

    with mirrored.scope():
        model = Holder(make_model(mirrored)[0])
        optimizers = {"net": keras.optimizers.SGD(0.1), "other": keras.optimizers.SGD(0.2)}
        for optimizer in optimizers.values():
            optimizer.build(model.net.trainable_variables)

    def step_fn(batch):
        return {"loss": tf.constant(0.0)}

    x, y = make_arrays(16)
    for callback, name in [
        (keras.callbacks.ReduceLROnPlateau("val_loss"), "Keras callback ReduceLROnPlateau"),
        (
            keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate),
            "Keras callback LearningRateScheduler",
        ),
        (ReduceLROnPlateau("loss"), r"ReduceLROnPlateau\('loss'\)"),
    ]:
        with pytest.raises(engine.UserError, match=rf"^{name} sets .*2 .*\(net, other\)"):
            make_trainer(
                mirrored,
                model=model,
                optimizer=optimizers,
                step_fn=step_fn,
                train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8),
                global_batch_size=8,
                cadence=engine.Cadence(steps_per_epoch=2),
                callbacks=[callback],
                loss_fn=None,
            )


# ------------------------------------------------------- one-line errors


def test_an_error_found_while_tracing_reaches_the_user_as_one_line(mirrored):
    x, y = make_arrays(32)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y, y, y)).repeat().batch(16),
        global_batch_size=16,
    )
    with pytest.raises(engine.UserError) as caught:
        trainer.train(2)
    assert str(caught.value).startswith("the standard step takes batches of (features, labels)")
    assert "in user code" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_step_fn_output_named_like_a_loop_count_is_logged_as_it_is(mirrored):
    """The loop's own counts travel apart from the step's outputs (`engine.loop.compiled.LoopResult`)."""
    x, y = make_arrays(32)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        step_fn=lambda batch: {"loss": tf.constant(1.0), "steps_run": tf.constant(5.0)},
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=2),
        loss_fn=None,
    )
    logs = trainer.train(2)
    assert logs["steps_run"] == 5.0 and trainer.step == 2


def test_a_step_fn_output_that_is_not_a_scalar_is_refused_naming_it(mirrored):
    x, y = make_arrays(32)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        step_fn=lambda batch: {"per_example": tf.ones([8])},
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16),
        global_batch_size=16,
        loss_fn=None,
    )
    with pytest.raises(
        engine.UserError, match=r"^step output 'per_example' has shape \[8\]: a step returns scalars"
    ):
        trainer.train(2)


def test_a_reduced_keras_loss_trains_as_its_per_element_form(mirrored):
    """Keras compile takes a loss with its default reduction; so does the Trainer (issue 47: it was
    refused), as the same loss with reduction=None, which the engine averages over the global batch."""
    x, y = make_arrays(16)

    def weights_after(loss_fn) -> list:
        model, optimizer = make_model(mirrored)
        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8),
            global_batch_size=8,
        )
        trainer.train(2)
        return [w.numpy() for w in model.weights]

    reduced = weights_after(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per_element = weights_after(keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
    for a, b in zip(reduced, per_element, strict=True):
        np.testing.assert_array_equal(a, b)
