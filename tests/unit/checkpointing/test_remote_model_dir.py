"""A model_dir on another of TensorFlow's file systems: TensorFlow's in-memory `ram://`
stands in for gs:// (both are reached only through tf.io.gfile, never `os`). A Trainer
trains there, is rebuilt (a restart) and resumes to the weights of an uninterrupted run;
its best checkpoint, hook state and the set-aside of an unreadable checkpoint live there too."""

import uuid

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import make_trainer

import engine
from engine.hooks import BestCheckpoint, EarlyStopping

NUM_FEATURES, NUM_CLASSES, BATCH = 6, 3, 16


def arrays():
    rng = np.random.RandomState(0)
    x = rng.rand(96, NUM_FEATURES).astype("float32")
    return x, (x[:, 0] * NUM_CLASSES).astype("int32") % NUM_CLASSES


def ram_trainer(model_dir, *, seed, callbacks=(), restore_fallback=False):
    """A small Trainer whose start weights depend on `seed`, so that a resumed run that did not
    restore ends with other weights than the uninterrupted one."""
    strategy = tf.distribute.get_strategy()
    model = keras.Sequential(
        [keras.Input((NUM_FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(NUM_CLASSES)]
    )
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    x, y = arrays()
    return make_trainer(
        strategy,
        model=model,
        optimizer=keras.optimizers.Adam(0.01),
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True),
        eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
        global_batch_size=BATCH,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        model_dir=model_dir,
        cadence=engine.Cadence(steps_per_loop=3, checkpoint_every=3, eval_every=3),
        callbacks=callbacks,
        checkpoint=engine.CheckpointOptions(restore_fallback=restore_fallback),
    )


@pytest.fixture
def ram_dir():
    path = f"ram://engine-test-{uuid.uuid4().hex}/run"
    yield path
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


def uninterrupted_weights(steps):
    trainer = ram_trainer(None, seed=1)
    trainer.train(steps)
    return trainer.model.get_weights()


def test_a_trainer_restarts_and_resumes_on_ram_with_its_hooks_files_there(ram_dir):
    hooks = [BestCheckpoint("loss"), EarlyStopping("loss", patience=100)]
    first = ram_trainer(ram_dir, seed=1, callbacks=hooks)
    first.train(6)
    assert first.step == 6
    del first

    # A restart: new objects, other start weights; everything comes back from ram://.
    second = ram_trainer(
        ram_dir, seed=2, callbacks=[BestCheckpoint("loss"), EarlyStopping("loss", patience=100)]
    )
    assert second.step == 6
    second.train(12)
    expected = uninterrupted_weights(12)
    for got, want in zip(second.model.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(got, want)

    checkpoints = tf.io.gfile.listdir(f"{ram_dir}/checkpoints")
    assert "ckpt-12.index" in checkpoints, checkpoints
    assert tf.io.gfile.exists(f"{ram_dir}/best/best.json")
    assert any(name.endswith(".index") for name in tf.io.gfile.listdir(f"{ram_dir}/best"))
    assert tf.io.gfile.exists(f"{ram_dir}/hooks/early_stopping.json")


@pytest.mark.slow
def test_an_unreadable_checkpoint_on_ram_is_set_aside_and_the_older_one_resumed(ram_dir):
    first = ram_trainer(ram_dir, seed=1)
    first.train(6)
    del first
    index = f"{ram_dir}/checkpoints/ckpt-6.index"
    size = tf.io.gfile.stat(index).length
    tf.io.gfile.remove(index)  # ram:// opens an existing file for writing at its end: replace it.
    with tf.io.gfile.GFile(index, "wb") as handle:
        handle.write(b"\0" * size)  # Zeroed, as a crashed disk leaves it.
    data = [name for name in tf.io.gfile.listdir(f"{ram_dir}/checkpoints") if name.startswith("ckpt-6.data")]

    with pytest.raises(engine.UserError, match="ckpt-6 cannot be read"):
        ram_trainer(ram_dir, seed=2)
    resumed = ram_trainer(ram_dir, seed=2, restore_fallback=True)
    assert resumed.step == 3
    assert sorted(tf.io.gfile.listdir(f"{ram_dir}/checkpoints/unreadable")) == sorted(["ckpt-6.index", data[0]])
    resumed.train(12)
    for got, want in zip(resumed.model.get_weights(), uninterrupted_weights(12), strict=True):
        np.testing.assert_array_equal(got, want)
