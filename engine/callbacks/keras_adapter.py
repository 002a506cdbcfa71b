"""Keras callbacks (`keras.callbacks.Callback`) driven by the engine's loop.

A user coming from `model.fit` brings `EarlyStopping`, `ReduceLROnPlateau`,
`CSVLogger` and callbacks of their own. `Trainer(callbacks=[...],
steps_per_epoch=N)` takes them beside the engine's hooks; this adapter turns
the trainer's loop and evaluation events into the calls `fit` makes:

- `set_model` / `set_params` and `on_train_begin` at the start of every
  `train()` call; `self.model` is a view of the model whose `optimizer` is
  the trainer's optimizer and whose `stop_training` stops the trainer (an
  uncompiled Keras model also gets `model.optimizer`, as `compile` sets it);
- `on_epoch_begin(epoch)` before the first loop of an epoch and
  `on_epoch_end(epoch, logs)` at its last step: compiled loops are cut at
  epoch boundaries (`loop_limit`), so an epoch is exactly `steps_per_epoch`
  global steps. `logs` holds the epoch's train loss and metrics (the mean
  over its loops weighted by their steps: exact for the loss and mean
  metrics such as accuracy) and, when an evaluation ran at that step, the
  eval ones prefixed `val_` (pass `eval_every=steps_per_epoch` to validate
  every epoch as `fit` does);
- `on_train_batch_begin` / `on_train_batch_end` once per compiled loop, not
  once per step: `batch` is the 0-based index in the epoch of the loop's
  first / last step, and the logs are the epoch's running means so far;
- `on_train_end` after the trainer's final checkpoint.

Callbacks whose job the engine does itself are refused with the engine's
equivalent: Keras's `ModelCheckpoint`, `TensorBoard` and `BackupAndRestore`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from engine.callbacks.base import Callback, TrainerView
from engine.errors import UserError
from engine.variables import all_variables

# Loop logs that describe the loop, not the model: left out of epoch logs, as fit leaves them out.
_LOOP_ONLY_KEYS = frozenset({"examples_per_second", "steps_per_second", "learning_rate", "nonfinite_steps"})

_REFUSED: dict[type, str] = {
    keras.callbacks.ModelCheckpoint: (
        "the engine saves checkpoints itself: pass `model_dir=` and "
        "`cadence=engine.Cadence(checkpoint_every=N)` to the Trainer, "
        "and `engine.hooks.BestCheckpoint(metric)` for save_best_only"
    ),
    keras.callbacks.TensorBoard: (
        "the engine writes TensorBoard summaries itself to <model_dir>/train and <model_dir>/eval "
        "(`engine.hooks.WeightHistograms(every)` for weight histograms, `engine.hooks.ProfileWindow` "
        "for a profile)"
    ),
    keras.callbacks.BackupAndRestore: (
        "the engine resumes automatically from the latest checkpoint in model_dir; rerun the same "
        "command or Trainer to continue"
    ),
}


# Callbacks that read and set `model.optimizer.learning_rate` (or swap one optimizer's averages).
_ONE_OPTIMIZER = (
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.SwapEMAWeights,
)


def is_keras_callback(hook: Any) -> bool:
    return isinstance(hook, keras.callbacks.Callback)


def check_supported(callback: keras.callbacks.Callback) -> None:
    """Refuses the Keras callbacks whose job the engine does, naming its equivalent."""
    for refused, instead in _REFUSED.items():
        if isinstance(callback, refused):
            raise UserError(f"Keras callback {type(callback).__name__} cannot run in the engine; {instead}")


class ModelView:
    """What a Keras callback sees as `self.model`: the model, plus the
    trainer's `optimizer` and a `stop_training` flag of its own.

    A view, so that a `tf.Module` works too and `stop_training` is read from
    one place; every other attribute (layers, weights, save ...) is the
    model's. `get_weights` / `set_weights` (EarlyStopping's
    `restore_best_weights`) are the model's own where it has them, else
    (a `tf.Module`) every variable of `engine.variables.all_variables`.
    """

    def __init__(self, model: Any, optimizer: keras.optimizers.Optimizer):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "stop_training", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def get_weights(self) -> list[np.ndarray]:
        if hasattr(self._model, "get_weights"):
            return self._model.get_weights()
        return [np.array(variable) for variable in all_variables(self._model)]

    def set_weights(self, weights: Sequence[Any]) -> None:
        if hasattr(self._model, "set_weights"):
            self._model.set_weights(weights)
            return
        variables = all_variables(self._model)
        if len(weights) != len(variables):
            raise ValueError(f"set_weights got {len(weights)} arrays for {len(variables)} variables")
        for variable, value in zip(variables, weights, strict=True):
            variable.assign(value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("stop_training", "optimizer"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)


class KerasCallbacks(Callback):
    """Drives a list of Keras callbacks at the epoch boundaries of `steps_per_epoch` steps."""

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback], *, steps_per_epoch: int | None):
        for callback in callbacks:
            check_supported(callback)
        if steps_per_epoch is None:
            names = ", ".join(type(c).__name__ for c in callbacks)
            raise UserError(
                f"Keras callbacks ({names}) act at epoch ends; pass `cadence=engine.Cadence(steps_per_epoch=N)` "
                "to the Trainer (N: the train split's examples // global batch size)"
            )
        if steps_per_epoch < 1:
            raise UserError(f"`steps_per_epoch={steps_per_epoch}` must be at least 1")
        self.callbacks = list(callbacks)
        self.steps_per_epoch = steps_per_epoch
        self.view: ModelView | None = None
        # A Keras callback that sets the rate keeps it across a restore, as the engine's plateau hook does.
        self.owns_learning_rate = any(
            isinstance(c, (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler))
            for c in callbacks
        )
        self._epoch: int | None = None  # The epoch begun and not yet ended.
        self._loop_start: int | None = None  # The step the running loop started at.
        self._last_step = 0  # The step at the end of the last loop: loop lengths weigh epoch means.
        self._sums: dict[str, float] = {}
        self._steps = 0
        self._pending: tuple[int, dict[str, float]] | None = None  # An epoch end awaiting its evaluation.
        self._last_epoch_logs: dict[str, float] = {}

    # ------------------------------------------------------------ engine hooks

    def check_trainer(self, trainer: TrainerView) -> None:
        if trainer.optimizer is not None:
            return
        for callback in self.callbacks:
            if isinstance(callback, _ONE_OPTIMIZER):
                raise UserError(
                    f"Keras callback {type(callback).__name__} sets model.optimizer's learning rate, but the "
                    f"trainer has {len(trainer.optimizers)} optimizers ({', '.join(trainer.optimizers)}): set "
                    "each rate in a callback of your own (trainer.optimizers[name]), or pass one optimizer"
                )

    def on_train_begin(self, trainer: TrainerView) -> None:
        self.view = ModelView(trainer.model, trainer.optimizer)
        if isinstance(trainer.model, keras.Model) and getattr(trainer.model, "optimizer", None) is None:
            # As compile() would have: callbacks written for fit read `model.optimizer` off the
            # model itself. It adds no variable to the model or its checkpoint.
            trainer.model.optimizer = trainer.optimizer
        if hasattr(trainer.model, "stop_training"):
            trainer.model.stop_training = False
        target = trainer.target_step or trainer.step
        params = {
            "verbose": 0,
            "epochs": math.ceil(target / self.steps_per_epoch),
            "steps": self.steps_per_epoch,
        }
        self._epoch, self._loop_start, self._pending = None, None, None
        self._sums, self._steps = {}, 0
        self._last_step = trainer.step
        for callback in self.callbacks:
            callback.set_model(self.view)
            callback.set_params(params)
        for callback in self.callbacks:
            callback.on_train_begin({})

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        """Cuts loops at epoch ends; called before each loop, so it also begins epochs and batches."""
        if self._loop_start != step:
            self._loop_start = step
            epoch = step // self.steps_per_epoch
            if self._epoch != epoch:
                self._epoch, self._sums, self._steps = epoch, {}, 0
                for callback in self.callbacks:
                    callback.on_epoch_begin(epoch, {})
            batch = step % self.steps_per_epoch
            for callback in self.callbacks:
                callback.on_train_batch_begin(batch, {})
        return self.steps_per_epoch - step % self.steps_per_epoch

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        num_steps, self._last_step = step - self._last_step, step
        self._loop_start = None
        for name, value in logs.items():
            if name not in _LOOP_ONLY_KEYS:
                self._sums[name] = self._sums.get(name, 0.0) + float(value) * num_steps
        self._steps += num_steps
        running = self._epoch_logs()
        batch = (step - 1) % self.steps_per_epoch
        for callback in self.callbacks:
            callback.on_train_batch_end(batch, dict(running))
        self._apply_stop(trainer)
        if step % self.steps_per_epoch:
            return
        if _evaluates_at(trainer, step):
            self._pending = (step, running)  # on_eval_end adds the val_ metrics and ends the epoch.
        else:
            self._end_epoch(trainer, step, running)

    def on_eval_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        if self._pending is None or self._pending[0] != step:
            return
        epoch_logs = dict(self._pending[1])
        self._pending = None
        epoch_logs.update(
            {f"val_{name}": float(value) for name, value in logs.items() if name != "num_examples"}
        )
        self._end_epoch(trainer, step, epoch_logs)

    def on_train_end(self, trainer: TrainerView, logs: Mapping[str, Any]) -> None:
        if self._pending is not None:  # An evaluation was due but the trainer did not run it.
            step, epoch_logs = self._pending
            self._pending = None
            self._end_epoch(trainer, step, epoch_logs)
        for callback in self.callbacks:
            callback.on_train_end(dict(self._last_epoch_logs))

    # ----------------------------------------------------------------- helpers

    def _epoch_logs(self) -> dict[str, float]:
        return {name: total / self._steps for name, total in self._sums.items()} if self._steps else {}

    def _end_epoch(self, trainer: TrainerView, step: int, logs: dict[str, float]) -> None:
        epoch = step // self.steps_per_epoch - 1
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, logs)  # One dict for all, as fit passes it: callbacks may add keys.
        self._last_epoch_logs = logs
        self._epoch, self._sums, self._steps = None, {}, 0
        self._apply_stop(trainer)

    def _apply_stop(self, trainer: TrainerView) -> None:
        """`model.stop_training = True` (on the view, or on a Keras model itself) stops the trainer."""
        assert self.view is not None, "on_train_begin made it"
        if self.view.stop_training or getattr(trainer.model, "stop_training", False) is True:
            trainer.stop_training = True


def _evaluates_at(trainer: TrainerView, step: int) -> bool:
    """Whether the trainer evaluates right after the loop that ends at `step`."""
    return trainer.evaluates_after(step)
