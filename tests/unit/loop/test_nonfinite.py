"""A NaN loss never reaches a checkpoint: stop naming the step, or skip and count."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import make_arrays, make_model, make_trainer

import engine
from engine.errors import NonFiniteLossError

BATCH = 16


def poisoned_loss_fn():
    """Cross-entropy that is NaN for examples labelled -1 (a scripted fault)."""
    cross_entropy = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def per_example(labels, logits):
        poisoned = labels < 0
        loss = cross_entropy(tf.maximum(labels, 0), logits)
        return tf.where(poisoned, tf.constant(np.nan, loss.dtype), loss)

    return per_example


def poisoned_batches(bad_steps, bad_rows=slice(None)):
    """Global batches whose 1-based steps in `bad_steps` give a NaN loss."""
    x, y = make_arrays(BATCH * 40)
    for step in bad_steps:
        y[(step - 1) * BATCH : step * BATCH][bad_rows] = -1
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)


def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(mirrored, tmp_path):
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=poisoned_batches([7]),
        global_batch_size=BATCH,
        loss_fn=poisoned_loss_fn(),
        cadence=engine.Cadence(steps_per_loop=4, checkpoint_every=4),
        model_dir=str(tmp_path),
    )
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 7; .*ckpt-4") as raised:
        trainer.train(12)
    # The model in memory is the checkpoint's again, not the spike's update: research code goes on with it.
    assert str(raised.value).endswith(
        "the model in memory is back at " + str(tmp_path / "checkpoints" / "ckpt-4") + " (step 4)"
    )
    assert trainer.step == 4
    state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
    assert state.model_checkpoint_path.endswith("ckpt-4")
    assert len(state.all_model_checkpoint_paths) == 1
    reader = tf.train.load_checkpoint(state.model_checkpoint_path)
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if np.issubdtype(np.asarray(value).dtype, np.floating):
            assert np.all(np.isfinite(value)), name
    fresh, _ = make_model(mirrored, seed=9)
    tf.train.Checkpoint(model=fresh).read(state.model_checkpoint_path).expect_partial()
    for held, saved in zip(model.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_array_equal(held, saved)


ONE_REPLICA = pytest.param(slice(0, 1), marks=pytest.mark.slow)  # The fast tier: the whole batch's case.


@pytest.mark.parametrize("bad_rows", [slice(None), ONE_REPLICA], ids=["whole_batch", "one_replica"])
def test_skip_leaves_weights_untouched_on_bad_steps_and_counts_them(mirrored, bad_rows):
    model, optimizer = make_model(mirrored)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=poisoned_batches([3, 6], bad_rows),
        global_batch_size=BATCH,
        loss_fn=poisoned_loss_fn(),
        cadence=engine.Cadence(steps_per_loop=2),
        step=engine.StepOptions(on_nonfinite="skip"),
    )
    trainer.train(2)
    before = [w.copy() for w in model.get_weights()]
    logs = trainer.train(3)  # step 3 alone: bad
    assert logs["nonfinite_steps"] == 1
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    logs = trainer.train(8)  # steps 4-5, 6-7 (one bad), 8
    assert trainer.step == 8 and np.isfinite(logs["loss"])
    for variable in model.trainable_variables:  # every replica made the same choice
        first, second = mirrored.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy())
        assert np.all(np.isfinite(first.numpy()))
