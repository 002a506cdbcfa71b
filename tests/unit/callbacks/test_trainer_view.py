"""Hooks use only `engine.callbacks.TrainerView`: every built-in hook (and the Keras-callback
adapter) runs a real training through a proxy that refuses anything else of the trainer."""

import keras
import numpy as np
import tensorflow as tf
from helpers import make_trainer

import engine
from engine.callbacks import Callback, TrainerView
from engine.callbacks.keras_adapter import KerasCallbacks
from engine.hooks import BestCheckpoint, EarlyStopping, ReduceLROnPlateau, TrainGraph, WeightHistograms

VIEW = {name for name in vars(TrainerView) if not name.startswith("_")} | set(TrainerView.__annotations__)
SETTABLE = {"stop_training"}


class OnlyTheView:
    """The trainer, with every name outside TrainerView refused."""

    def __init__(self, trainer):
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name):
        if name not in VIEW:
            raise AssertionError(f"a hook read trainer.{name}, which is not in TrainerView")
        return getattr(self._trainer, name)

    def __setattr__(self, name, value):
        if name not in SETTABLE:
            raise AssertionError(f"a hook set trainer.{name}, which TrainerView does not let it set")
        setattr(self._trainer, name, value)


class ThroughTheView(Callback):
    """Calls `hook` with `OnlyTheView(trainer)` instead of the trainer."""

    def __init__(self, hook: Callback):
        self.hook = hook
        self.owns_learning_rate = hook.owns_learning_rate

    def loop_limit(self, trainer, step):
        return self.hook.loop_limit(OnlyTheView(trainer), step)

    def on_train_begin(self, trainer):
        self.hook.on_train_begin(OnlyTheView(trainer))

    def on_loop_end(self, trainer, step, logs):
        self.hook.on_loop_end(OnlyTheView(trainer), step, logs)

    def on_eval_end(self, trainer, step, logs):
        self.hook.on_eval_end(OnlyTheView(trainer), step, logs)

    def on_train_end(self, trainer, logs):
        self.hook.on_train_end(OnlyTheView(trainer), logs)


def test_every_built_in_hook_needs_only_the_trainer_view(tmp_path):
    assert {
        "step",
        "target_step",
        "model",
        "optimizer",
        "optimizers",
        "strategy",
        "model_dir",
        "summaries",
        "checkpoint",
        "stop_training",
        "evaluates_after",
        "averaged_weights",
    } == VIEW
    rng = np.random.RandomState(0)
    x = rng.rand(64, 4).astype("float32")
    y = (x[:, 0] > 0.5).astype("int32")
    strategy = tf.distribute.get_strategy()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    hooks = [
        BestCheckpoint("loss"),
        EarlyStopping("loss", patience=1, min_delta=10.0),
        ReduceLROnPlateau("loss", patience=1, min_delta=10.0),
        TrainGraph(),
        WeightHistograms(2),
        KerasCallbacks([keras.callbacks.History()], steps_per_epoch=4),
    ]
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=keras.optimizers.SGD(0.1),
        train_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16, drop_remainder=True),
        eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
        global_batch_size=16,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        model_dir=str(tmp_path),
        cadence=engine.Cadence(steps_per_loop=2, eval_every=2, checkpoint_every=2),
        callbacks=[ThroughTheView(hook) for hook in hooks],
    )
    trainer.train(8)
    # The hooks acted through the view: early stopping stopped at the second evaluation
    # (min_delta=10 makes every later value "no better"), the best checkpoint was saved.
    assert trainer.step == 4
    assert (tmp_path / "best" / "best.json").exists()
    assert float(trainer.optimizer.learning_rate.numpy()) < 0.1
