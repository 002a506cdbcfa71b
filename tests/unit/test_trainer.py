"""The numerical promises of the Trainer: equal weights across strategies,
loss arithmetic, exact evaluation, one trace, resume at the saved step.

Covers: engine/loop/compiled.py, engine/loop/runners.py.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, NUM_FEATURES, global_batches, make_arrays, make_model, make_trainer

import engine


def per_replica_batches(x, y, batch):
    """fn(input_context) whose replica r at step k gets the same examples as
    replica r of the split global batch (one input pipeline)."""

    def dataset_fn(input_context):
        per_replica = input_context.get_per_replica_batch_size(batch)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_replica, drop_remainder=True)

    return dataset_fn


def train_weights(strategy, data, *, batch=16, steps=12, l2=0.0, **trainer_kwargs):
    trainer = make_trainer(
        strategy, l2=l2, train_data=data, batch=batch, cadence=engine.Cadence(steps_per_loop=5), **trainer_kwargs
    )
    trainer.train(steps)
    assert trainer.step == steps
    return trainer.model.get_weights()


@functools.cache
def plain_weights(strategy_name: str, l2: float = 0.0) -> tuple[np.ndarray, ...]:
    """`train_weights` of `strategy_name` on the global batches of `make_arrays(64)`, without
    options: the reference several tests compare with, trained once per process (read-only)."""
    x, y = make_arrays(64)
    strategy = engine.build_strategy(strategy_name, cpu_devices=2)
    weights = train_weights(strategy, global_batches(x, y, 16), l2=l2)
    for weight in weights:
        weight.flags.writeable = False
    return tuple(weights)


# The fast tier trains the per-replica function form in the eval test below; here the global dataset.
PER_REPLICA_FN_SLOW = pytest.param("per_replica_fn", marks=pytest.mark.slow)


@pytest.mark.parametrize("input_form", ["global_dataset", PER_REPLICA_FN_SLOW])
def test_two_replicas_train_to_the_same_weights_as_one_device(default, mirrored, input_form):
    x, y = make_arrays(64)
    data = global_batches(x, y, 16) if input_form == "global_dataset" else per_replica_batches(x, y, 16)
    single = plain_weights("default")
    assert mirrored.num_replicas_in_sync == 2
    two = plain_weights("mirrored") if input_form == "global_dataset" else train_weights(mirrored, data)
    for a, b in zip(single, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(single[0], make_model(default)[0].get_weights()[0])  # It did train.


def test_clipping_and_accumulation_keep_replicas_equal(default, mirrored):
    x, y = make_arrays(64)
    options = dict(step=engine.StepOptions(clip_norm=0.05, grad_accum_steps=2))
    single = train_weights(default, global_batches(x, y, 16), **options)
    two = train_weights(mirrored, global_batches(x, y, 16), **options)
    for a, b in zip(single, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_accum_steps", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_regularized_two_replicas_equal_one_device_whole_batch(default, mirrored, grad_accum_steps):
    """With l2 > 0 the regularization loss is divided by the replicas and by
    the micro-batches: 2 replicas (accumulating or not) match 1 device."""
    x, y = make_arrays(64)
    single = plain_weights("default", l2=0.05)
    two = train_weights(
        mirrored, global_batches(x, y, 16), l2=0.05, step=engine.StepOptions(grad_accum_steps=grad_accum_steps)
    )
    for a, b in zip(single, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unregularized = plain_weights("default")
    assert not np.allclose(single[0], unregularized[0], rtol=1e-3, atol=1e-4)  # l2 did change the weights


def test_gradient_accumulation_equals_the_whole_batch(mirrored):
    x, y = make_arrays(64)
    whole = plain_weights("mirrored")
    accumulated = train_weights(mirrored, global_batches(x, y, 16), step=engine.StepOptions(grad_accum_steps=4))
    for a, b in zip(whole, accumulated, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_clip_norm_bounds_the_global_update(mirrored):
    x, y = make_arrays(16)
    model, optimizer = make_model(mirrored)
    before = [w.copy() for w in model.get_weights()]
    trainer = make_trainer(
        mirrored, arrays=(x, y), model=model, optimizer=optimizer, step=engine.StepOptions(clip_norm=0.01)
    )
    trainer.train(1)
    update = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(model.get_weights(), before, strict=True)))
    np.testing.assert_allclose(update, 0.5 * 0.01, rtol=1e-4)  # learning rate x clip norm


def softmax_cross_entropy(logits, labels):
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels]


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_reported_loss_equals_a_hand_computation(strategy_name, request):
    strategy = request.getfixturevalue(strategy_name)
    x, y = make_arrays(16)
    model, optimizer = make_model(strategy, l2=0.01)
    w1, b1, w2, b2 = model.get_weights()
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    expected = softmax_cross_entropy(logits, y).mean() + 0.01 * (w1**2).sum()
    trainer = make_trainer(strategy, arrays=(x, y), model=model, optimizer=optimizer)
    logs = trainer.train(1)  # The loss is computed before the one update.
    np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)


@pytest.mark.parametrize("num_examples", [37, 33])  # 33: one replica's last batch is empty
@pytest.mark.parametrize("input_form", ["global_dataset", "per_replica_fn"])
def test_eval_counts_every_example_once_and_metrics_are_exact(mirrored, num_examples, input_form):
    x, y = make_arrays(num_examples, seed=1)
    model, optimizer = make_model(mirrored)
    if input_form == "global_dataset":
        eval_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    else:

        def eval_data(input_context):
            batch = input_context.get_per_replica_batch_size(16)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    trainer = make_trainer(
        mirrored,
        arrays=(x, y),
        model=model,
        optimizer=optimizer,
        eval_data=eval_data,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    logs = trainer.evaluate()
    logits = model.predict(x, verbose=0)
    assert logs["num_examples"] == num_examples
    np.testing.assert_allclose(logs["loss"], softmax_cross_entropy(logits, y).mean(), rtol=1e-5)
    np.testing.assert_allclose(logs["accuracy"], (logits.argmax(1) == y).mean(), rtol=1e-6)
    assert trainer.evaluate() == logs  # Metrics are reset between evaluations.


def test_train_and_eval_loops_are_traced_once(mirrored):
    x, y = make_arrays(64)
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        arrays=(x, y),
        model=model,
        optimizer=optimizer,
        cadence=engine.Cadence(steps_per_loop=4, eval_every=6),
        eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
    )
    trainer.train(7)  # loops of 4, 2 (cut by eval), 1
    trainer.train(20)  # loops of 4 and 1 .. of various lengths
    trainer.evaluate()
    assert trainer.step == 20
    assert trainer.train_loop.experimental_get_tracing_count() == 1
    assert trainer.eval_loop.experimental_get_tracing_count() == 1


def test_restart_restores_the_latest_checkpoint_and_continues(mirrored, tmp_path):
    x, y = make_arrays(64)
    data = global_batches(x, y, 16)

    def new_trainer():
        model, optimizer = make_model(mirrored, seed=99)  # Different start: the checkpoint must win.
        return make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=data,
            global_batch_size=16,
            model_dir=str(tmp_path),
            cadence=engine.Cadence(checkpoint_every=4),
            checkpoint=engine.CheckpointOptions(max_checkpoints=2),
        )

    first = new_trainer()
    first.train(6)
    saved = first.model.get_weights()
    second = new_trainer()
    assert second.step == 6
    for a, b in zip(saved, second.model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    second.train(10)
    assert second.step == 10
    kept = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints")).all_model_checkpoint_paths
    assert [p.rsplit("-", 1)[1] for p in kept] == ["8", "10"]


def test_variables_created_outside_the_scope_are_refused(mirrored):
    x, y = make_arrays(16)
    model, optimizer = make_model(tf.distribute.get_strategy())
    with pytest.raises(engine.UserError, match="strategy.scope"):
        make_trainer(mirrored, arrays=(x, y), model=model, optimizer=optimizer)


def test_batch_not_divisible_by_replicas_is_refused(mirrored):
    x, y = make_arrays(16)
    model, optimizer = make_model(mirrored)
    with pytest.raises(engine.UserError, match="not divisible by 2 replica"):
        make_trainer(mirrored, model=model, optimizer=optimizer, arrays=(x, y), batch=15)


def test_xla_step_trains_to_the_same_weights(mirrored):
    x, y = make_arrays(64)
    plain = plain_weights("mirrored")
    compiled = train_weights(mirrored, global_batches(x, y, 16), step=engine.StepOptions(jit_compile=True))
    for a, b in zip(plain, compiled, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", [pytest.param("mixed_float16", marks=pytest.mark.slow), "mixed_bfloat16"])
def test_mixed_precision_trains_with_two_replicas(mirrored, policy):
    x, y = make_arrays(256)
    keras.mixed_precision.set_global_policy(policy)
    try:
        with mirrored.scope():
            model = keras.Sequential(
                [
                    keras.Input((NUM_FEATURES,)),
                    keras.layers.Dense(32, activation="relu"),
                    keras.layers.Dense(NUM_CLASSES, dtype="float32"),
                ]
            )
            optimizer = keras.optimizers.SGD(0.5)
            if policy == "mixed_float16":
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        trainer = make_trainer(
            mirrored,
            arrays=(x, y),
            batch=32,
            model=model,
            optimizer=optimizer,
            cadence=engine.Cadence(steps_per_loop=20),
            step=engine.StepOptions(clip_norm=10.0),
        )
        first = trainer.train(20)["loss"]
        last = trainer.train(200)["loss"]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.layers[0].kernel.dtype == "float32"  # float32 master weights
    assert np.isfinite(last) and last < 0.7 * first


def test_build_strategy_reuses_one_mirrored_strategy_per_device_list(mirrored):
    # A second MirroredStrategy over the same devices would number its
    # collectives like the first and could abort them; asking again is safe.
    assert engine.build_strategy("mirrored", cpu_devices=2) is mirrored


def test_a_stop_request_after_the_workers_agreement_waits_for_the_next_one(tmp_path):
    """Multi-worker, the all-reduced request alone decides when to stop: a signal that lands
    on one worker just after the loop's agreement (its peers saw no request) must not stop
    that worker a loop early, or its peers lose it mid-collective (they ended with exit 69
    instead of stopping at one step). Two workers' agreements, played by a stand-in peer."""
    from helpers import small_trainer

    trainer = small_trainer(tmp_path)
    calls = []

    def agreement(wanted):  # SUM over this worker and a peer that never asks to stop (the flag first)
        calls.append(float(wanted[0]))
        if len(calls) == 1:
            trainer.request_stop()  # the signal lands while the first all-reduce runs
        return wanted + 0.0

    trainer.stopping.all_reduce = agreement
    trainer.train(8)
    assert calls == [0.0, 1.0]  # asked at the first agreement, agreed at the second
    assert trainer.step == 2 and trainer.stop_agreed  # one loop ran, as on the peer
