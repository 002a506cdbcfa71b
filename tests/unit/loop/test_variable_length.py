"""Variable-length sequences on several replicas (issue 47): an `Embedding` fed by `padded_batch`
(a new sequence length each batch) trains with the default `steps_per_loop` exactly as one step
per call (`engine.loop.variable_length`); before, TensorFlow aborted every collective of the
process ("Shape mismatch in the collective instance") at the loop's second step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import id_sequences, loss_fn, make_trainer

import engine
from engine.options import DEFAULT_STEPS_PER_LOOP

VOCAB, CLASSES, BATCH = 30, 3, 8


def variable_length(count: int, seed: int = 0) -> tf.data.Dataset:
    """`count` sequences of 1 to 12 ids, each batch padded to its own longest one."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 13, size=count)
    ids = [rng.randint(1, VOCAB, size=length).astype("int32") for length in lengths]
    labels = np.array([row[0] % CLASSES for row in ids], dtype="int32")
    signature = (tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))
    examples = tf.data.Dataset.from_generator(lambda: zip(ids, labels, strict=True), output_signature=signature)
    return examples.padded_batch(BATCH)


def embedding_model(strategy):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((None,), dtype="int32"),
                keras.layers.Embedding(VOCAB, 4, mask_zero=True),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = keras.optimizers.Adam(0.05)
    rng = np.random.RandomState(1)  # Same start for every strategy.
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model, optimizer


def train(strategy, data, steps: int, **options):
    model, optimizer = embedding_model(strategy)
    trainer = make_trainer(
        strategy, model=model, optimizer=optimizer, train_data=data, global_batch_size=BATCH, **options
    )
    trainer.train(steps)
    return [w.copy() for w in model.get_weights()], int(trainer.global_step.numpy())


def assert_bitwise(left, right):
    for a, b in zip(left, right, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "options",
    [
        {},
        pytest.param({"step": engine.StepOptions(grad_accum_steps=2)}, marks=pytest.mark.slow),
        # One more all-reduce of the gradients.
        pytest.param({"step": engine.StepOptions(clip_norm=0.5)}, marks=pytest.mark.slow),
        pytest.param({"step": engine.StepOptions(on_nonfinite="skip")}, marks=pytest.mark.slow),
    ],
    ids=["standard", "accumulate", "clip", "skip"],
)
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_padded_batch_trains_in_the_default_loop_as_one_step_per_call(mirrored, default, options):
    assert DEFAULT_STEPS_PER_LOOP > 1
    data = variable_length(64).repeat()
    looped, steps = train(mirrored, data, 6, **options)  # The default steps_per_loop.
    assert steps == 6
    one_per_call, _ = train(mirrored, data, 6, cadence=engine.Cadence(steps_per_loop=1), **options)
    assert_bitwise(looped, one_per_call)
    one_replica, _ = train(default, data, 6, **options)
    for a, b in zip(looped, one_replica, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def warnings_of(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    return [line for line in lines if "vary in length" in line]


def loop_ends(caplog) -> list[str]:
    """The progress lines: one after every compiled call (no `log_every`)."""
    return [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")]


def test_the_fallback_is_said_once_with_its_cost_and_the_way_out(mirrored, caplog):
    caplog.set_level("INFO", logger="engine")
    train(mirrored, variable_length(64).repeat(), 3)
    (line,) = warnings_of(caplog)
    assert f"1 step per compiled call instead of steps_per_loop={DEFAULT_STEPS_PER_LOOP}" in line
    assert "on 2 replicas" in line and "padded_shapes" in line and "[None, None]" in line
    assert loop_ends(caplog) == ["1/3", "2/3", "3/3"]


@pytest.mark.parametrize("case", ["fixed padded_shapes", "one replica", "steps_per_loop=1"])
def test_fixed_lengths_one_replica_or_one_step_loops_keep_their_loops(mirrored, default, caplog, case):
    caplog.set_level("INFO", logger="engine")
    ids, labels = id_sequences(64, vocab=VOCAB, length=6, classes=CLASSES)
    data = variable_length(64).repeat()
    strategy, options = mirrored, {}
    if case == "fixed padded_shapes":
        rows = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat()
        data = rows.padded_batch(BATCH, padded_shapes=([12], []))
    elif case == "one replica":
        strategy = default
    else:
        options = {"cadence": engine.Cadence(steps_per_loop=1)}
    train(strategy, data, 3, **options)
    assert warnings_of(caplog) == []
    assert loop_ends(caplog) == (["1/3", "2/3", "3/3"] if options else ["3/3"])


@pytest.mark.slow  # Trains twice with a step of its own.
def test_a_step_fn_of_its_own_trains_variable_lengths_in_the_default_loop(mirrored):
    def run(**options):
        model, optimizer = embedding_model(mirrored)
        per_example = loss_fn()

        def step_fn(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(per_example(labels, model(features)), global_batch_size=BATCH)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return {"loss": loss}

        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            train_data=variable_length(64).repeat(),
            global_batch_size=BATCH,
            loss_fn=None,
            step_fn=step_fn,
            **options,
        )
        trainer.train(6)
        return model.get_weights()

    assert_bitwise(run(), run(cadence=engine.Cadence(steps_per_loop=1)))


def test_variable_length_evaluation_on_two_replicas_counts_every_example_as_keras(mirrored):
    model, optimizer = embedding_model(mirrored)
    trainer = make_trainer(
        strategy=mirrored,
        model=model,
        optimizer=optimizer,
        train_data=variable_length(64).repeat(),
        eval_data=variable_length(61, seed=5),  # A partial last batch of 5 too.
        global_batch_size=BATCH,
        loss_fn=loss_fn(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    logs = trainer.evaluate()
    with mirrored.scope():
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
    expected = model.evaluate(variable_length(61, seed=5), verbose=0, return_dict=True)
    assert logs["num_examples"] == 61
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert logs["sparse_categorical_accuracy"] == pytest.approx(expected["sparse_categorical_accuracy"])


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_a_partial_last_batch_of_an_embedding_model_trains_in_a_call_of_its_own(mirrored, caplog):
    caplog.set_level("INFO", logger="engine")
    ids, labels = id_sequences(60, vocab=VOCAB, length=6, classes=CLASSES)  # 7 batches of 8, then 4.
    data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    with pytest.raises(engine.DataExhaustedError, match="after step 8 of 20"):
        train(mirrored, data, 20)
    assert loop_ends(caplog) == ["7/20", "8/20"] and warnings_of(caplog) == []
    looped, _ = train(mirrored, data, 8)  # Ends with the partial batch, as steps_per_loop=1 does.
    one_per_call, _ = train(mirrored, data, 8, cadence=engine.Cadence(steps_per_loop=1))
    assert_bitwise(looped, one_per_call)
