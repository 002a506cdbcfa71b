"""Lower the learning rate when an eval metric plateaus (`--reduce_lr_metric`).

The reduced rate lives in the optimizer's learning-rate variable, which is
in every checkpoint. While this hook is on, the trainer does not reset the
rate after a restore (`owns_learning_rate`), so a reduced rate survives a
restart; the patience counter is rebuilt from the metric history.
"""

from __future__ import annotations

import tensorflow as tf

from engine.callbacks import TrainerView
from engine.errors import UserError
from engine.hooks.metric_watch import PatienceHook
from engine.logger import logger
from engine.schedules import is_scheduled


class ReduceLROnPlateau(PatienceHook):
    """Multiplies the learning rate by `factor` (not below `min_rate`) after
    `patience` evaluations without improvement, then waits `patience` again."""

    name = "reduce_lr_on_plateau"
    owns_learning_rate = True

    def __init__(
        self,
        metric: str,
        *,
        patience: int = 2,
        factor: float = 0.5,
        min_rate: float = 0.0,
        mode: str = "auto",
        min_delta: float = 0.0,
    ):
        super().__init__(metric, patience=patience, mode=mode, min_delta=min_delta)
        if not 0.0 < factor < 1.0:
            raise UserError(f"`ReduceLROnPlateau(factor={factor})` must be between 0 and 1 (exclusive)")
        if min_rate < 0:
            raise UserError(f"`ReduceLROnPlateau(min_rate={min_rate})` must not be negative")
        self.factor = factor
        self.min_rate = min_rate

    def check_trainer(self, trainer: TrainerView) -> None:
        if trainer.optimizer is None:
            raise UserError(
                f"ReduceLROnPlateau({self.metric!r}) sets one optimizer's learning rate, but the trainer has "
                f"{len(trainer.optimizers)} ({', '.join(trainer.optimizers)}); pass one optimizer, or lower "
                "each rate in a callback of your own"
            )
        self._refuse_a_schedule(trainer)

    def on_train_begin(self, trainer: TrainerView) -> None:
        self._refuse_a_schedule(trainer)  # Again: the optimizer's rate may have been replaced since.
        super().on_train_begin(trainer)

    @staticmethod
    def _refuse_a_schedule(trainer: TrainerView) -> None:
        if is_scheduled(trainer.optimizer):
            raise UserError(
                "reducing the learning rate on a plateau needs a constant learning rate, but the "
                "optimizer follows a schedule; give the optimizer a float `learning_rate` (not a "
                "schedule), or drop the ReduceLROnPlateau callback"
            )

    def on_patience_exhausted(self, trainer: TrainerView, step: int, replaying: bool) -> None:
        self.watch.wait = 0
        if replaying:
            return  # The checkpoint already holds the rate this reduction produced.
        optimizer = trainer.optimizer
        assert optimizer is not None, "ReduceLROnPlateau is for a trainer with one optimizer"
        old = float(tf.convert_to_tensor(optimizer.learning_rate))
        new = max(old * self.factor, self.min_rate)
        if new < old:
            optimizer.learning_rate = new
            logger.info(
                "reduce lr on plateau at step %d: eval %s stuck at best %.6g; learning rate %.4g -> %.4g",
                step,
                self.metric,
                self.watch.best,
                old,
                new,
            )
