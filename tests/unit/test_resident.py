"""Device-resident training data (`engine.ResidentData`): the same batches as the
tf.data path, the same weights, and exact resume, on 1 and 2 replicas; a resident eval
split (`engine.ResidentEvalData`): every example once, the figures of the tf.data path and Keras."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import make_trainer

import engine
from input import get_data_source

SHAPE = (8, 8, 1)
BATCH = 16  # 1,500 digits / 16: an epoch ends mid-batch at step 93, crossed below.


@pytest.fixture(scope="module")
def digits():
    return get_data_source("digits", image_shape=SHAPE)


@pytest.fixture(params=["default", pytest.param("mirrored", marks=pytest.mark.slow)])  # fast tier: default
def strategy(request):
    return request.getfixturevalue(request.param)


def resident_batches(strategy, data, steps):
    """Each replica's batch of each global step, as the resident loop gathers it."""

    @tf.function
    def batch_of(replica_tensors, step):
        return strategy.run(
            lambda tensors, step: data.batch_at(tensors, step, global_batch_size=BATCH),
            args=(replica_tensors, step),
        )

    placed = engine.resident.place_on_replicas(strategy, data)
    return [
        [tuple(strategy.experimental_local_results(part)) for part in batch_of(placed, tf.constant(s, tf.int64))]
        for s in steps
    ]


def iterator_batches(strategy, data_fn, start, count):
    """The same steps through the per-replica tf.data path the engine used before."""
    dataset = strategy.distribute_datasets_from_function(lambda context: data_fn(context, start_step=start))
    iterator = iter(dataset)
    return [[tuple(strategy.experimental_local_results(part)) for part in next(iterator)] for _ in range(count)]


def test_resident_batches_equal_the_tf_data_path(strategy, digits):
    data = digits.resident_train_data(global_batch_size=BATCH, seed=5)
    for start in (0, 90):  # 90: the batches of steps 93 and 94 span the end of the first epoch.
        expected = iterator_batches(strategy, data.host_data, start, 6)
        assert_same_batches(
            expected, resident_batches(strategy, data, range(start, start + 6)), strategy.num_replicas_in_sync
        )


def cnn_trainer(strategy, train_data, model_dir=None):
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(SHAPE),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )
        optimizer = keras.optimizers.Adam(1e-2)
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        global_batch_size=BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        cadence=engine.Cadence(steps_per_loop=7),
        model_dir=None if model_dir is None else str(model_dir),
    )
    return trainer, model


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_training_on_resident_data_equals_the_tf_data_path_and_resumes_bitwise(strategy, digits, tmp_path):
    data = digits.resident_train_data(global_batch_size=BATCH, seed=3)
    through_tf_data, expected_model = cnn_trainer(strategy, data.host_data)
    expected_logs = through_tf_data.train(100)  # Past the epoch boundary at step 93.

    resident, model = cnn_trainer(strategy, data)
    logs = resident.train(100)
    assert resident.step == 100 and int(resident.optimizer.iterations.numpy()) == 100
    if strategy.num_replicas_in_sync == 1:
        for got, want in zip(model.get_weights(), expected_model.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want)
        assert logs["loss"] == expected_logs["loss"] and logs["accuracy"] == expected_logs["accuracy"]
    else:
        # Same batches (tested above), but with 2 replicas the step graphs differ (the
        # batch is gathered inside it, with a static shape) and from the second step on a
        # bias gradient is summed in another order: the weights agree to float32 rounding.
        for got, want in zip(model.get_weights(), expected_model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert logs["accuracy"] == expected_logs["accuracy"]
    resident_weights = model.get_weights()

    interrupted, _ = cnn_trainer(strategy, data, tmp_path)
    interrupted.train(45)
    resumed, resumed_model = cnn_trainer(strategy, data, tmp_path)
    assert resumed.step == 45
    resumed.train(100)
    for got, want in zip(resumed_model.get_weights(), resident_weights, strict=True):
        np.testing.assert_array_equal(got, want)


def assert_same_batches(expected, got, replicas):
    for step_expected, step_got in zip(expected, got, strict=True):
        for part_expected, part_got in zip(step_expected, step_got, strict=True):  # images, labels
            assert len(part_got) == replicas
            for replica_expected, replica_got in zip(part_expected, part_got, strict=True):
                np.testing.assert_array_equal(replica_got.numpy(), replica_expected.numpy())


def test_shuffled_arrays_every_epoch_a_new_order_same_batches_either_way(strategy):
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    y = np.arange(100, dtype=np.int32)
    data = engine.ResidentData.shuffled((x, y), seed=9, global_batch_size=BATCH)
    got = resident_batches(strategy, data, range(0, 13))  # 13 x 16 = 208 examples: two epochs and a bit.
    assert_same_batches(iterator_batches(strategy, data.host_data, 0, 13), got, strategy.num_replicas_in_sync)
    assert_same_batches(
        iterator_batches(strategy, data.host_data, 5, 3), got[5:8], strategy.num_replicas_in_sync
    )
    labels = np.concatenate([np.concatenate([r.numpy() for r in step[1]]) for step in got])
    first, second = labels[:100], labels[100:200]
    assert sorted(first) == list(range(100)) and sorted(second) == list(range(100))  # Each epoch: all once.
    assert list(first) != list(second) and list(first) != list(range(100))  # Shuffled, anew each epoch.
    np.testing.assert_array_equal(np.concatenate([r.numpy() for r in got[0][0]]), x[labels[:BATCH]])


def test_resident_data_refuses_tensors_of_different_lengths():
    with pytest.raises(ValueError, match=r"one non-zero first dimension.*\[3, 4\]"):
        engine.ResidentData(tensors=(np.zeros((3, 2)), np.zeros(4)), indices=tf.identity, host_data=None)


@pytest.mark.process
@pytest.mark.slow
def test_cli_keeps_digits_on_the_devices_and_trains_as_through_tf_data(tmp_path):
    from helpers import in_background, model_weights, run_main

    common = ("--model=mlp", "--train_steps=120", "--steps_per_loop=25", "--eval_every=0", "--seed=4")
    streamed = in_background(run_main, *common, "--device_data_mb=0", f"--model_dir={tmp_path / 'streamed'}")
    resident = run_main(*common, f"--model_dir={tmp_path / 'resident'}")  # Both processes at once.
    streamed = streamed.result()
    runs = ("resident", "streamed")
    assert resident.returncode == 0 and streamed.returncode == 0, (
        resident.stderr[-2000:] + streamed.stderr[-2000:]
    )
    assert "1,500 train / 297 eval  kept on the devices" in resident.stderr
    assert "1,500 train / 297 eval  through tf.data" in streamed.stderr
    got, want = model_weights(tmp_path / "resident", 120), model_weights(tmp_path / "streamed", 120)
    assert got.keys() == want.keys() and len(got) > 1
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # The eval split kept beside it: the final evaluation's figures are the streamed run's.
    got_eval, want_eval = (json.loads((tmp_path / run / "metrics.json").read_text())["eval"] for run in runs)
    assert got_eval == want_eval and got_eval["num_examples"] == 297


def test_resident_data_as_eval_data_is_refused(default):
    data = engine.ResidentData.shuffled(
        (np.zeros((40, 3), np.float32), np.zeros(40, np.int32)), seed=0, global_batch_size=8
    )
    with default.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(engine.UserError, match=r"eval_data cannot be ResidentData"):
        make_trainer(
            default,
            model=model,
            optimizer=optimizer,
            train_data=data,
            eval_data=data,
            global_batch_size=8,
            loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        )


def test_resident_data_made_for_another_batch_size_is_refused(default):
    data = engine.ResidentData.shuffled(
        (np.zeros((40, 3), np.float32), np.zeros(40, np.int32)), seed=0, global_batch_size=8
    )
    with default.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(
        engine.UserError, match=r"made for `global_batch_size=8` but the Trainer has `global_batch_size=16`"
    ):
        make_trainer(
            default,
            model=model,
            optimizer=optimizer,
            train_data=data,
            global_batch_size=16,
            loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        )


# ------------------------------------------------------------------ the eval split on the devices

EVAL_BATCH = 8  # 37 examples: 5 global batches, the last of 5 (on 2 replicas: 4 and 1).


def eval_arrays():
    rng = np.random.default_rng(7)
    return (
        rng.normal(size=(37, 5)).astype(np.float32),
        rng.integers(0, 3, size=37).astype(np.int32),
        rng.uniform(size=37).astype(np.float32),
    )


def eval_trainer(strategy, eval_data):
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
    x, y, _ = eval_arrays()
    return make_trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(EVAL_BATCH),
        eval_data=eval_data,
        global_batch_size=EVAL_BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")],
        cadence=engine.Cadence(steps_per_loop=2),  # Evaluations in calls of 2 batches: 3 calls.
    )


def test_resident_eval_data_evaluates_every_example_once_as_the_tf_data_path_and_keras(strategy, monkeypatch):
    arrays = eval_arrays()
    batches = tf.data.Dataset.from_tensor_slices(arrays).batch(EVAL_BATCH)
    streamed = eval_trainer(strategy, batches).evaluate()
    resident_trainer = eval_trainer(
        strategy, engine.ResidentEvalData(arrays, host_data=batches, global_batch_size=EVAL_BATCH)
    )

    def no_iterator(*args):
        raise AssertionError("a resident evaluation made an iterator")

    monkeypatch.setattr(engine.loop.runners, "distribute_eval_data", no_iterator)
    first, second = resident_trainer.evaluate(), resident_trainer.evaluate()
    assert first == second and first["num_examples"] == streamed["num_examples"] == 37
    assert resident_trainer.eval_loop.experimental_get_tracing_count() == 1
    reference = keras.models.clone_model(resident_trainer.model)
    reference.set_weights(resident_trainer.model.get_weights())
    reference.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")],
    )
    keras_logs = reference.evaluate(batches, return_dict=True, verbose=0)
    for name in ("loss", "accuracy", "weighted_accuracy"):
        np.testing.assert_allclose(first[name], streamed[name], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(first[name], keras_logs[name], rtol=1e-6, err_msg=name)


def test_a_stop_between_calls_cuts_a_resident_evaluation_short_and_the_next_counts_whole(default):
    arrays = eval_arrays()
    host = tf.data.Dataset.from_tensor_slices(arrays).batch(EVAL_BATCH)
    trainer = eval_trainer(
        default, engine.ResidentEvalData(arrays, host_data=host, global_batch_size=EVAL_BATCH)
    )
    calls = []
    counted = trainer.eval_runner.loop

    def counting(*args):
        calls.append(1)
        return counted(*args)

    trainer.eval_runner.loop = counting
    assert trainer.eval_runner.run(stop_requested=lambda: True) is None
    assert len(calls) == 1
    assert trainer.eval_runner.run()["num_examples"] == 37
    assert len(calls) == 4


def test_resident_eval_data_reads_its_host_data_where_the_strategy_cannot_keep_it(default, monkeypatch):
    from engine.data import GlobalBatches
    from engine.trainer import checks as trainer_checks

    arrays = eval_arrays()
    host = tf.data.Dataset.from_tensor_slices(arrays).batch(EVAL_BATCH)
    data = engine.ResidentEvalData(arrays, host_data=host, global_batch_size=EVAL_BATCH)
    assert trainer_checks.eval_data_form(default, data, EVAL_BATCH) is data
    monkeypatch.setattr(trainer_checks, "keeps_on_devices", lambda strategy: False)  # As under ps and tpu.
    form = trainer_checks.eval_data_form(default, data, EVAL_BATCH)
    assert isinstance(form, GlobalBatches) and form.dataset is host


def test_resident_eval_data_made_for_another_batch_size_or_of_uneven_tensors_is_refused(default):
    arrays = eval_arrays()
    host = tf.data.Dataset.from_tensor_slices(arrays).batch(16)
    with pytest.raises(
        engine.UserError, match=r"made for `global_batch_size=16` but the Trainer has `global_batch_size=8`"
    ):
        eval_trainer(default, engine.ResidentEvalData(arrays, host_data=host, global_batch_size=16))
    with pytest.raises(ValueError, match=r"one non-zero first dimension.*\[3, 4\]"):
        engine.ResidentEvalData((np.zeros((3, 2)), np.zeros(4)), host_data=None, global_batch_size=8)


class BranchingModule(tf.Module):
    """A model with a Python `if` on a tensor: it traces only where AutoGraph converts it."""

    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(tf.ones((5, 3)))

    def __call__(self, features, training=False):
        logits = features @ self.kernel
        if tf.reduce_sum(logits) > 0:
            logits = logits * 2.0
        return logits


def test_the_users_python_control_flow_is_converted_in_the_resident_loops(default):
    x, y, _ = eval_arrays()
    host = tf.data.Dataset.from_tensor_slices((x, y)).batch(EVAL_BATCH)
    trainer = make_trainer(
        default,
        model=BranchingModule(),
        optimizer=keras.optimizers.SGD(0.1),
        train_data=engine.ResidentData.shuffled((x, y), seed=0, global_batch_size=EVAL_BATCH),
        eval_data=engine.ResidentEvalData((x, y), host_data=host, global_batch_size=EVAL_BATCH),
        global_batch_size=EVAL_BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        cadence=engine.Cadence(steps_per_loop=2),
    )
    assert np.isfinite(trainer.train(4)["loss"])
    assert trainer.evaluate()["num_examples"] == 37
