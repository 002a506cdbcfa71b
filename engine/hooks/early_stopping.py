"""Stop training when an eval metric stops improving (`--early_stop_metric`)."""

from __future__ import annotations

from engine.callbacks import TrainerView
from engine.hooks.metric_watch import PatienceHook
from engine.logger import logger


class EarlyStopping(PatienceHook):
    """Sets `trainer.stop_training` after `patience` evaluations without a
    better `metric` (by more than `min_delta`); the trainer then saves and
    returns at that step.

    The decision is kept across restarts: rerunning a job that stopped early
    stops again at once, unless a larger patience lets it continue.
    """

    name = "early_stopping"

    def on_patience_exhausted(self, trainer: TrainerView, step: int, replaying: bool) -> None:
        if replaying:
            return  # on_train_begin decides from the state after the whole replay.
        trainer.stop_training = True
        logger.info(
            "early stopping at step %d: eval %s has not improved on %.6g for %d evaluations",
            step,
            self.metric,
            self.watch.best,
            self.watch.wait,
        )

    def on_train_begin(self, trainer: TrainerView) -> None:
        super().on_train_begin(trainer)
        if self.watch.wait >= self.patience:
            trainer.stop_training = True
            logger.info(
                "early stopping: the restored run already stopped (eval %s best %.6g, "
                "%d evaluations without improvement); raise the patience to continue",
                self.metric,
                self.watch.best,
                self.watch.wait,
            )
