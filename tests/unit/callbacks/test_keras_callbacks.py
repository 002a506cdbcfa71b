"""Keras callbacks passed to the Trainer behave as under `model.fit`: epochs
of `steps_per_epoch` steps, train and `val_` logs at epoch ends, and
`model.stop_training` stopping the run.

Covers: engine/callbacks/keras_adapter.py.
"""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, NUM_FEATURES, global_batches, make_arrays, make_model, make_trainer

import engine
from engine.callbacks import Callback

STEPS_PER_EPOCH = 5
BATCH = 16


class EpochRecorder(keras.callbacks.Callback):
    """The seed's custom callback: something of the user's own at each epoch end."""

    def __init__(self):
        super().__init__()
        self.epochs: list[tuple[int, dict]] = []
        self.learning_rates: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, dict(logs)))
        self.learning_rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


class EngineRecorder(Callback):
    """The engine's own view of the same run, to check the Keras logs against."""

    def __init__(self):
        self.loops: list[tuple[int, dict]] = []
        self.evals: dict[int, dict] = {}

    def on_loop_end(self, trainer, step, logs):
        self.loops.append((step, dict(logs)))

    def on_eval_end(self, trainer, step, logs):
        self.evals[step] = dict(logs)


def overfitting_run(strategy):
    """Learnable train data, eval labels that are noise: val_loss rises as training goes on."""
    x, y = make_arrays(160)
    x_eval, _ = make_arrays(64, seed=1)
    y_eval = np.random.RandomState(2).randint(0, NUM_CLASSES, size=64).astype("int32")
    model, optimizer = make_model(strategy)
    eval_data = tf.data.Dataset.from_tensor_slices((x_eval, y_eval)).batch(BATCH)
    return model, optimizer, global_batches(x, y, BATCH), eval_data


def test_the_seeds_callbacks_run_against_the_trainer(mirrored, tmp_path, capsys):
    model, optimizer, train_data, eval_data = overfitting_run(mirrored)
    early = keras.callbacks.EarlyStopping(monitor="val_loss", patience=3)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=1e-4)
    recorder = EpochRecorder()

    class PrintLR(keras.callbacks.Callback):
        """As in the seed: reads the rate off the (global) model, not self.model."""

        def on_epoch_end(self, epoch, logs=None):
            print(f"Learning rate for epoch {epoch + 1} is {model.optimizer.learning_rate.numpy()}")

    csv_path = tmp_path / "log.csv"
    engine_view = EngineRecorder()
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        eval_data=eval_data,
        global_batch_size=BATCH,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        model_dir=str(tmp_path / "run"),
        cadence=engine.Cadence(steps_per_loop=3, eval_every=STEPS_PER_EPOCH, steps_per_epoch=STEPS_PER_EPOCH),
        callbacks=[early, plateau, recorder, PrintLR(), keras.callbacks.CSVLogger(str(csv_path)), engine_view],
    )
    target = 40 * STEPS_PER_EPOCH
    trainer.train(target)

    # EarlyStopping stopped the trainer at an epoch end, which was saved.
    epochs = [epoch for epoch, _ in recorder.epochs]
    assert epochs == list(range(len(epochs)))
    assert trainer.step < target and trainer.step == len(epochs) * STEPS_PER_EPOCH
    assert early.stopped_epoch == epochs[-1] and early.wait >= early.patience
    assert trainer.checkpoint_manager.latest_checkpoint.endswith(f"ckpt-{trainer.step}")
    # Loops were cut at epoch ends (3 + 2 steps) without a retrace.
    assert [step for step, _ in engine_view.loops][:4] == [3, 5, 8, 10]
    assert trainer.train_loop.experimental_get_tracing_count() == 1

    for epoch, logs in recorder.epochs:
        end = (epoch + 1) * STEPS_PER_EPOCH
        loops = [(step, loop) for step, loop in engine_view.loops if end - STEPS_PER_EPOCH < step <= end]
        lengths = np.diff([end - STEPS_PER_EPOCH] + [step for step, _ in loops])
        for name in ("loss", "accuracy"):  # The epoch's mean: its loops weighted by their steps.
            expected = sum(n * loop[name] for n, (_, loop) in zip(lengths, loops, strict=True)) / STEPS_PER_EPOCH
            assert logs[name] == pytest.approx(expected, rel=1e-6)
        assert logs["val_loss"] == engine_view.evals[end]["loss"]
        assert logs["val_accuracy"] == engine_view.evals[end]["accuracy"]

    # ReduceLROnPlateau lowered the rate the optimizer trains with.
    assert recorder.learning_rates[0] == 0.5
    final_rate = float(tf.convert_to_tensor(optimizer.learning_rate))
    assert final_rate < 0.5 and final_rate == pytest.approx(recorder.learning_rates[-1])
    assert any(b < a for a, b in zip(recorder.learning_rates, recorder.learning_rates[1:], strict=False))

    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Learning rate")]
    assert printed[0] == "Learning rate for epoch 1 is 0.5" and len(printed) == len(epochs)
    assert printed[-1] == f"Learning rate for epoch {len(epochs)} is {recorder.learning_rates[-1]}"

    # CSVLogger: a row per epoch with the train and val metrics.
    with open(csv_path) as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["epoch"]) for row in rows] == epochs
    for row, (_, logs) in zip(rows, recorder.epochs, strict=True):
        for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert float(row[name]) == pytest.approx(logs[name], rel=1e-6)


class SoftmaxRegression(tf.Module):
    def __init__(self):
        self.w = tf.Variable(tf.zeros([NUM_FEATURES, NUM_CLASSES]), name="w")

    def __call__(self, x):
        return x @ self.w


class StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.stop_epoch = epoch
        self.seen_optimizer = None

    def on_epoch_end(self, epoch, logs=None):
        self.seen_optimizer = self.model.optimizer
        if epoch == self.stop_epoch:
            self.model.stop_training = True


def test_a_tf_module_model_gets_epochs_batches_and_a_stop(mirrored, tmp_path):
    x, y = make_arrays(160)
    with mirrored.scope():
        model = SoftmaxRegression()
        optimizer = keras.optimizers.SGD(0.1)
    events = []
    stopper = StopAtEpoch(2)
    trainer = make_trainer(
        mirrored,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        batch=BATCH,
        model_dir=str(tmp_path),
        cadence=engine.Cadence(steps_per_loop=3, steps_per_epoch=STEPS_PER_EPOCH),
        callbacks=[
            keras.callbacks.TerminateOnNaN(),
            keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: events.append(("epoch_begin", epoch)),
                on_batch_begin=lambda batch, logs: events.append(("batch_begin", batch)),
                on_batch_end=lambda batch, logs: events.append(("batch_end", batch, "loss" in logs)),
                on_train_end=lambda logs: events.append(("train_end", sorted(logs))),
            ),
            stopper,
        ],
    )
    trainer.train(100)
    assert trainer.step == 3 * STEPS_PER_EPOCH
    assert stopper.seen_optimizer is optimizer
    one_epoch = [("batch_begin", 0), ("batch_end", 2, True), ("batch_begin", 3), ("batch_end", 4, True)]
    assert events == [
        ("epoch_begin", 0),
        *one_epoch,
        ("epoch_begin", 1),
        *one_epoch,
        ("epoch_begin", 2),
        *one_epoch,
        ("train_end", ["loss"]),
    ]

    # A restarted trainer continues the epoch count from the restored step.
    events.clear()
    with mirrored.scope():
        restarted = SoftmaxRegression()
        optimizer = keras.optimizers.SGD(0.1)
    trainer = make_trainer(
        mirrored,
        model=restarted,
        optimizer=optimizer,
        arrays=(x, y),
        batch=BATCH,
        model_dir=str(tmp_path),
        cadence=engine.Cadence(steps_per_loop=3, steps_per_epoch=STEPS_PER_EPOCH),
        callbacks=[
            keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: events.append(("epoch_begin", epoch))
            )
        ],
    )
    trainer.train(5 * STEPS_PER_EPOCH)
    assert events == [("epoch_begin", 3), ("epoch_begin", 4)]


@pytest.mark.parametrize(
    "callback, equivalent",
    [
        (
            keras.callbacks.ModelCheckpoint("/tmp/never.keras"),
            r"`cadence=engine\.Cadence\(checkpoint_every=N\)`",
        ),
        (keras.callbacks.TensorBoard("/tmp/never"), "TensorBoard summaries itself"),
        (keras.callbacks.BackupAndRestore("/tmp/never"), "resumes automatically"),
    ],
)
def test_callbacks_the_engine_replaces_are_refused_naming_its_equivalent(mirrored, callback, equivalent):
    model, optimizer = make_model(mirrored)
    x, y = make_arrays(32)
    with pytest.raises(engine.UserError, match=f"{type(callback).__name__} cannot run.*{equivalent}"):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            arrays=(x, y),
            batch=BATCH,
            cadence=engine.Cadence(steps_per_epoch=STEPS_PER_EPOCH),
            callbacks=[callback],
        )


def test_keras_callbacks_without_steps_per_epoch_are_refused(mirrored):
    model, optimizer = make_model(mirrored)
    x, y = make_arrays(32)
    with pytest.raises(
        engine.UserError, match=r"EarlyStopping.*`cadence=engine\.Cadence\(steps_per_epoch=N\)` to the Trainer"
    ):
        make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            arrays=(x, y),
            batch=BATCH,
            callbacks=[keras.callbacks.EarlyStopping()],
        )
