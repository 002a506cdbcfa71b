"""The research API off the paved path: wrapped Keras models, several
optimizers, finite data, wrong batch sizes and structures, stopping,
logging and the public names. Each case as a research user meets it.

Covers: engine/__init__.py, engine/trainer/checks.py, engine/variables.py, engine/logger.py.
"""

import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    NUM_CLASSES,
    NUM_FEATURES,
    REPO,
    global_batches,
    loss_fn,
    make_arrays,
    make_model,
    make_trainer,
)

import engine
from engine.variables import all_variables, trainable_variables


class Wrapped(tf.Module):
    """The usual research wrapper: a tf.Module holding a Keras model."""

    def __init__(self, net: keras.Model):
        super().__init__()
        self.net = net
        self.scale = tf.Variable(1.0, name="scale")

    def __call__(self, x, training=False):
        return self.net(x, training=training) * self.scale


def assert_weights_equal(a, b):
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


def weights(variables):
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


# ---------------------------------------------------------------- variables


def test_variables_are_found_through_module_and_keras_nesting():
    class KerasHoldingModule(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = Wrapped(
                keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization()])
            )
            self.head = keras.layers.Dense(1)

        def call(self, x):
            return self.head(self.inner(x))

    model = KerasHoldingModule()
    model(np.zeros((1, 3), "float32"))
    # Dense (2) + BatchNorm gamma/beta (2) + scale + head (2); BatchNorm's moving stats are not trainable.
    assert len(trainable_variables(model)) == 7
    assert len(all_variables(model)) == 9
    assert len(model.trainable_variables) == 2  # What Keras alone sees: the head.
    assert len(trainable_variables(model.inner)) == 5
    assert len(model.inner.trainable_variables) == 1  # What tf.Module alone sees: `scale`.


def test_a_model_without_trainable_variables_is_refused(mirrored):
    with mirrored.scope():
        model = Wrapped(keras.Sequential([keras.layers.Dense(2)]))  # Never built: no kernel yet.
        model.scale = tf.Variable(1.0, trainable=False)
        optimizer = keras.optimizers.SGD(0.1)
    x, y = make_arrays(16)
    with pytest.raises(engine.UserError, match=r"model \(Wrapped\) has no trainable variables"):
        make_trainer(mirrored, arrays=(x, y), batch=8, model=model, optimizer=optimizer)


def test_module_wrapping_keras_trains_like_the_keras_model_and_resumes(mirrored, tmp_path):
    x, y = make_arrays(64)
    data = global_batches(x, y, 16)

    def wrapped_trainer(seed):
        net, optimizer = make_model(mirrored, seed=seed)
        with mirrored.scope():
            model = Wrapped(net)
        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=data,
            global_batch_size=16,
            cadence=engine.Cadence(steps_per_loop=5),
            model_dir=str(tmp_path),
        )
        return trainer, model

    trainer, model = wrapped_trainer(seed=3)
    before = model.net.get_weights()
    first = trainer.train(5)
    last = trainer.train(10)
    assert last["loss"] < first["loss"]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(before, model.net.get_weights(), strict=True))
    assert int(trainer.optimizer.iterations.numpy()) == trainer.step == 10
    assert float(model.scale.numpy()) != 1.0  # The module's own variable trains too.
    resumed, resumed_model = wrapped_trainer(seed=99)  # A different start: the checkpoint must win.
    assert resumed.step == 10
    assert_weights_equal(model.net.get_weights(), resumed_model.net.get_weights())
    assert float(resumed_model.scale.numpy()) == float(model.scale.numpy())


def test_module_wrapping_keras_equals_the_keras_model_step_for_step(mirrored):
    """With no extra variable the wrapped model is the Keras model: equal weights after training."""

    class Holder(tf.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def __call__(self, x, training=False):
            return self.net(x, training=training)

    x, y = make_arrays(64)
    results = []
    for wrap in (False, True):
        net, optimizer = make_model(mirrored)
        with mirrored.scope():
            model = Holder(net) if wrap else net
        trainer = make_trainer(
            mirrored, arrays=(x, y), model=model, optimizer=optimizer, cadence=engine.Cadence(steps_per_loop=4)
        )
        logs = trainer.train(8)
        results.append((net.get_weights(), logs["loss"]))
    assert_weights_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


# --------------------------------------------------------------- optimizers


class EncoderDecoder(tf.Module):
    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(4)])
        self.decoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(NUM_FEATURES)])


def two_optimizer_trainer(strategy, model_dir, seed=0):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = EncoderDecoder()
        optimizers = {"encoder": keras.optimizers.Adam(0.01), "decoder": keras.optimizers.SGD(0.1)}
    x, _ = make_arrays(64)

    def replica_step(batch):
        # Two updates a step, each with its own optimizer (as a GAN's two players).
        with tf.GradientTape(persistent=True) as tape:
            code = model.encoder(batch)
            per_example = tf.reduce_mean(tf.square(model.decoder(code) - batch), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
        for name in ("encoder", "decoder"):
            variables = getattr(model, name).trainable_variables
            optimizers[name].apply(tape.gradient(loss, variables), variables)
        return {"loss": tf.reduce_mean(per_example)}

    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizers,
        step_fn=replica_step,
        train_data=tf.data.Dataset.from_tensor_slices(x).repeat().batch(16),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=3),
        model_dir=str(model_dir),
        loss_fn=None,
    )
    return trainer, model, optimizers


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_two_optimizers_train_and_resume_without_a_manual_build(mirrored, tmp_path):
    straight, straight_model, _ = two_optimizer_trainer(mirrored, tmp_path / "straight")
    logs = straight.train(6)
    assert {"learning_rate/encoder", "learning_rate/decoder"} <= set(logs)
    assert logs["learning_rate/decoder"] == pytest.approx(0.1)

    stopped, _, _ = two_optimizer_trainer(mirrored, tmp_path / "resumed")
    stopped.train(3)
    resumed, resumed_model, optimizers = two_optimizer_trainer(mirrored, tmp_path / "resumed", seed=7)
    assert resumed.step == 3
    assert [int(o.iterations.numpy()) for o in optimizers.values()] == [3, 3]  # Both checkpointed.
    resumed.train(6)
    assert_weights_equal(weights(all_variables(straight_model)), weights(all_variables(resumed_model)))


def test_an_unbuilt_optimizer_the_engine_cannot_place_is_named(mirrored):
    with mirrored.scope():
        model = EncoderDecoder()
        optimizers = {"encoder": keras.optimizers.Adam(0.01), "critic": keras.optimizers.SGD(0.1)}
    x, _ = make_arrays(16)
    with pytest.raises(engine.UserError, match=r"optimizer 'critic' is not built .*optimizer.build"):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizers,
            step_fn=lambda b: {},
            train_data=tf.data.Dataset.from_tensor_slices(x).batch(8),
            global_batch_size=8,
            loss_fn=None,
        )


def test_several_optimizers_need_a_step_fn(mirrored):
    model, optimizer = make_model(mirrored)
    x, y = make_arrays(16)
    with pytest.raises(engine.UserError, match=r"standard step applies one optimizer.*step_fn"):
        make_trainer(mirrored, arrays=(x, y), batch=8, model=model, optimizer={"a": optimizer, "b": optimizer})


# -------------------------------------------------------------- finite data


@pytest.mark.parametrize("steps_per_loop", [4, 5])  # Runs out inside a loop / exactly at a loop's start.
def test_finite_data_stops_at_the_last_update_with_a_checkpoint(mirrored, tmp_path, steps_per_loop):
    x, y = make_arrays(160)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 10 batches.
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=finite,
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=steps_per_loop),
        model_dir=str(tmp_path),
    )
    with pytest.raises(engine.DataExhaustedError, match=r"ran out after step 10 of 25.*\.repeat\(\)") as caught:
        trainer.train(25)
    assert caught.value.step == trainer.step == 10
    assert int(optimizer.iterations.numpy()) == 10
    assert trainer.checkpoint_manager.latest_checkpoint.endswith("ckpt-10")
    reader = tf.train.load_checkpoint(trainer.checkpoint_manager.latest_checkpoint)
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == 10

    repeated, repeated_optimizer = make_model(mirrored)
    make_trainer(
        mirrored,
        model=repeated,
        optimizer=repeated_optimizer,
        train_data=finite.repeat(),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=steps_per_loop),
    ).train(10)
    assert_weights_equal(model.get_weights(), repeated.get_weights())
    with pytest.raises(engine.DataExhaustedError):  # Asking again cannot pretend to train.
        trainer.train(25)
    assert trainer.step == 10


# --------------------------------------------------------------- batch size


def test_a_static_batch_of_the_wrong_size_is_refused_at_construction(mirrored, tmp_path):
    x, y = make_arrays(64)
    model, optimizer = make_model(mirrored)
    with pytest.raises(engine.UserError, match=r"batches of 32 examples but `global_batch_size=64`"):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=global_batches(x, y, 32),
            global_batch_size=64,
            model_dir=str(tmp_path),
        )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("form", [pytest.param("dataset", marks=pytest.mark.slow), "per_replica_fn"])  # ~20 s
def test_a_dynamic_batch_of_the_wrong_size_is_refused_before_any_update(mirrored, tmp_path, form):
    x, y = make_arrays(256)
    if form == "dataset":  # No drop_remainder: the batch dimension is unknown until it runs.
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
        expected = r"first batch holds 32 examples but `global_batch_size=64`"
    else:  # Batched by the global size instead of input_context.get_per_replica_batch_size.

        def data(input_context):
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)

        expected = r"first batch holds 64 examples per replica but `global_batch_size=64` over 2 .* needs 32"
    model, optimizer = make_model(mirrored)
    before = model.get_weights()
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=data,
        global_batch_size=64,
        model_dir=str(tmp_path),
    )
    with pytest.raises(engine.UserError, match=expected):
        trainer.train(4)
    assert trainer.step == 0 and int(optimizer.iterations.numpy()) == 0
    assert_weights_equal(before, model.get_weights())
    assert trainer.checkpoint_manager.latest_checkpoint is None


# ----------------------------------------------------------- batch structure


def multi_input_model(strategy):
    with strategy.scope():
        first = keras.Input((NUM_FEATURES,), name="first")
        second = keras.Input((2,), name="second")
        hidden = keras.layers.Concatenate()([first, second])
        model = keras.Model({"first": first, "second": second}, keras.layers.Dense(NUM_CLASSES)(hidden))
        optimizer = keras.optimizers.SGD(0.5)
    return model, optimizer


def test_multi_input_model_trains_and_evaluates_on_dict_features(mirrored):
    x, y = make_arrays(64)
    features = {"first": x, "second": x[:, :2] * 2}
    data = tf.data.Dataset.from_tensor_slices((features, y))
    model, optimizer = multi_input_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=data.repeat().batch(16, drop_remainder=True),
        eval_data=data.batch(24),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=4),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    first = trainer.train(4)
    assert trainer.train(40)["loss"] < first["loss"]
    results = trainer.evaluate()
    assert results["num_examples"] == 64
    logits = model({name: tf.constant(value) for name, value in features.items()})
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
    assert results["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_sample_weights_weigh_the_loss_like_keras(mirrored):
    x, y = make_arrays(32)
    weight = np.where(np.arange(32) % 2 == 0, 1.0, 0.0).astype("float32")
    weighted, optimizer = make_model(mirrored)
    make_trainer(
        mirrored,
        model=weighted,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y, weight)).batch(16),
        global_batch_size=16,
        cadence=engine.Cadence(steps_per_loop=2),
    ).train(2)
    # By hand, as Keras weighs: sum(weight * loss) / batch size; odd examples count for nothing.
    zeroed, zeroed_optimizer = make_model(mirrored)
    with tf.GradientTape() as tape:
        per_example = loss_fn()(y[:16], zeroed(x[:16])) * weight[:16]
        loss = tf.reduce_sum(per_example) / 16
    variables = zeroed.trainable_variables
    zeroed_optimizer.apply(tape.gradient(loss, variables), variables)
    with tf.GradientTape() as tape:
        per_example = loss_fn()(y[16:], zeroed(x[16:])) * weight[16:]
        loss = tf.reduce_sum(per_example) / 16
    zeroed_optimizer.apply(tape.gradient(loss, variables), variables)
    for a, b in zip(weighted.get_weights(), zeroed.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_dict_batch_is_refused_with_a_pointer_to_step_fn(mirrored):
    x, y = make_arrays(32)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).repeat().batch(16),
        global_batch_size=16,
    )
    with pytest.raises(
        engine.UserError,
        match=r"takes batches of \(features, labels\).*got a dict with "
        r"keys \['x', 'y'\].*step_fn=",
    ):
        trainer.train(2)
    assert trainer.step == 0


def test_eval_step_fn_evaluates_dict_batches(mirrored):
    x, y = make_arrays(48)
    model, optimizer = make_model(mirrored)
    dict_data = tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(16)

    def eval_step(batch):
        return batch["y"], model(batch["x"])

    trainer = make_trainer(
        mirrored, arrays=(x, y), model=model, optimizer=optimizer, eval_data=dict_data, eval_step_fn=eval_step
    )
    results = trainer.evaluate()
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(tf.constant(x)))
    assert results["num_examples"] == 48
    assert results["loss"] == pytest.approx(float(expected), rel=1e-5)


# --------------------------------------------------------- step_fn options


def test_step_fn_with_options_it_cannot_honour_is_refused(mirrored):
    x, y = make_arrays(16)
    model, optimizer = make_model(mirrored)
    with pytest.raises(
        engine.UserError,
        match=r"step_fn cannot honour clip_norm=1.0, grad_accum_steps=2, "
        r"jit_compile=True, on_nonfinite='skip'",
    ):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            step_fn=lambda batch: {},
            arrays=(x, y),
            batch=8,
            step=engine.StepOptions(clip_norm=1.0, grad_accum_steps=2, jit_compile=True, on_nonfinite="skip"),
            loss_fn=None,
        )


# ---------------------------------------------------------------- stopping


def test_a_stop_stays_in_force_until_cleared_and_reaching_the_target_says_so(mirrored, caplog):
    caplog.set_level(logging.INFO, logger="engine")
    x, y = make_arrays(32)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored, arrays=(x, y), model=model, optimizer=optimizer, cadence=engine.Cadence(steps_per_loop=2)
    )
    trainer.train(4)
    for stop in (trainer.request_stop, lambda: setattr(trainer, "stop_training", True)):
        stop()
        assert trainer.train(8) == {} and trainer.step == 4  # Both kinds: in force across train() calls.
        trainer.clear_stop()
    trainer.request_stop()
    trainer.clear_stop()
    assert trainer.train(8) and trainer.step == 8
    assert trainer.train(6) == {} and trainer.step == 8
    messages = [r.getMessage() for r in caplog.records if r.name == "engine"]
    assert any("a stop is in force at step 4" in m and "clear_stop" in m for m in messages)
    assert any("nothing to train: the global step 8 is already at or past steps=6" in m for m in messages)


# ------------------------------------------------------- defaults and names


def test_one_steps_per_loop_default_for_the_trainer_and_the_cli():
    import inspect

    from engine.cli.config import flags as engine_flags
    from engine.cli.config.settings import DEFAULT_STEPS_PER_LOOP, RunConfig

    trainer_default = inspect.signature(engine.Trainer).parameters["cadence"].default
    assert trainer_default is None  # The group's own defaults.
    assert engine.Cadence().steps_per_loop == RunConfig().steps_per_loop == DEFAULT_STEPS_PER_LOOP
    assert engine_flags.FLAGS["steps_per_loop"].default == DEFAULT_STEPS_PER_LOOP


def run_script(tmp_path, source: str, *, native_log_level: str | None = "2") -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL=native_log_level or "")
    if native_log_level is None:
        del env["TF_CPP_MIN_LOG_LEVEL"]
    return subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.process
@pytest.mark.slow
def test_public_names_work_after_import_engine_alone(tmp_path):
    result = run_script(
        tmp_path,
        """
import engine
assert callable(engine.export.export_saved_model)
assert engine.callbacks.Callback is engine.Callback
assert engine.hooks.EarlyStopping and engine.schedules.learning_rate_schedule
assert issubclass(engine.NonFiniteLossError, engine.UserError)
assert issubclass(engine.DataExhaustedError, engine.UserError)
from engine.errors import NonFiniteLossError
assert NonFiniteLossError is engine.NonFiniteLossError
print("ok")
""",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


EMBEDDED = """
import engine
import logging
import numpy as np, tensorflow as tf, keras
{silence}
strategy = engine.build_strategy("default")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
x = np.ones((32, 4), "float32"); y = np.zeros(32, "int32")
trainer = engine.Trainer(  # raw Trainer: a user's script, as the README embeds the loop
    strategy=strategy, model=model, optimizer=optimizer, global_batch_size=8,
    cadence=engine.Cadence(steps_per_loop=2),
    train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8), model_dir="run",
    loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
trainer.train(4)
logging.warning("a library logs through the root logger")  # It configures logging mid-run.
trainer.save()
"""


@pytest.mark.process
@pytest.mark.slow
def test_progress_reaches_an_embedded_user_without_tensorflow_info_logs(tmp_path):
    from helpers import in_background

    from engine.native_logs import kept_lines

    # As the README has it: engine imported first, no TF_CPP_MIN_LOG_LEVEL set by the user.
    (tmp_path / "silenced").mkdir()
    silence = 'logging.getLogger("engine").setLevel(logging.WARNING)'
    silenced = in_background(run_script, tmp_path / "silenced", EMBEDDED.format(silence=silence))  # At once.
    shown = run_script(tmp_path, EMBEDDED.format(silence=""), native_log_level=None)
    assert shown.returncode == 0, shown.stderr[-3000:]
    progress = [line for line in shown.stderr.splitlines() if " engine] step " in line]
    assert [line.split(" step ")[1].split()[0] for line in progress] == ["2/4", "4/4"]
    assert "Collective" not in shown.stderr and "INFO:tensorflow" not in shown.stderr
    # No C++ start-up line (oneDNN, cpu_feature_guard, cuInit) and one format for every engine line,
    # also after another library configured the root logger.
    assert kept_lines(shown.stderr, 3) == shown.stderr, shown.stderr[-3000:]
    engine_lines = [line for line in shown.stderr.splitlines() if "engine" in line and "Saved" in line]
    assert len(engine_lines) == 2 and all(" engine] Saved checkpoint" in line for line in engine_lines), (
        engine_lines
    )
    silenced = silenced.result()
    assert silenced.returncode == 0, silenced.stderr[-3000:]
    assert " engine] " not in silenced.stderr


@pytest.mark.cli
@pytest.mark.slow
def test_float16_with_a_schedule_reruns_in_the_same_model_dir(tmp_path):
    """A LossScaleOptimizer's own `_learning_rate` is not the rate: the restore must not reset a schedule."""
    from helpers import main_in_process

    common = [  # 4 and 8 steps: both runs in this process (main_in_process puts the dtype policy back)
        "--model=mlp",
        "--mixed_precision=float16",
        "--lr_schedule=cosine",
        "--steps_per_loop=2",
        f"--model_dir={tmp_path}",
    ]
    first = main_in_process(*common, "--train_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    rerun = main_in_process(*common, "--train_steps=8")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done: step 8" in rerun.stderr


def test_a_layer_built_lazily_in_the_first_step_is_refused(mirrored):
    with mirrored.scope():
        model = Wrapped(
            keras.Sequential(
                [keras.Input((NUM_FEATURES,)), keras.layers.Dense(4), keras.layers.Dense(NUM_CLASSES)]
            )
        )
        model.extra = keras.layers.Dense(NUM_CLASSES)  # Unbuilt: its kernel appears in the first call.
        optimizer = keras.optimizers.SGD(0.1)

    class Lazy(tf.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def __call__(self, x, training=False):
            return self.inner.extra(self.inner(x))

    with mirrored.scope():
        lazy = Lazy()
    x, y = make_arrays(16)
    trainer = make_trainer(mirrored, arrays=(x, y), batch=8, model=lazy, optimizer=optimizer)
    with pytest.raises(engine.UserError, match=r"model \(Lazy\) created variables in its first call"):
        trainer.train(1)
    assert trainer.step == 0
