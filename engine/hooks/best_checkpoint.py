"""Keep the best checkpoint by an eval metric, beside the rolling ones.

`<model_dir>/best` holds one checkpoint (its own `CheckpointManager`,
max_to_keep=1) and `best.json` with the metric, its value and the step, so
a restarted run keeps comparing against the real best rather than
starting over. `best.json` is written before the checkpoint it describes,
so a crash between the two never leaves a better checkpoint behind a worse
recorded value. Without a trustworthy `best.json` beside a best checkpoint
(missing, damaged, or kept by another metric) the run is refused: comparing
against nothing would replace the best with a worse one. With a moving
average of the weights (`--ema_decay`) the saved model holds the averages,
which are what the evaluation judged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import tensorflow as tf
from absl import logging

from engine import model_dir as model_dir_lib
from engine.callbacks import Callback, TrainerView
from engine.errors import UserError
from engine.hooks.metric_watch import MetricWatch, metric_value

BEST_SUBDIR = "best"
BEST_FILE = "best.json"


class BestCheckpoint(Callback):
    """Saves a checkpoint whenever `metric` beats the best evaluation so far."""

    def __init__(self, metric: str, mode: str = "auto", min_delta: float = 0.0):
        self.metric = metric
        self.watch = MetricWatch(metric, mode, min_delta)
        self.best_step: int | None = None
        self._manager: tf.train.CheckpointManager | None = None

    @property
    def best(self) -> float | None:
        return self.watch.best

    def on_train_begin(self, trainer: TrainerView) -> None:
        self.restore_state(trainer)

    def restore_state(self, trainer: TrainerView) -> None:
        """Reads `best/` (once); raises UserError when it cannot be trusted.
        `engine.job` calls it before writing anything to the model_dir."""
        if self._manager is not None:
            return
        if trainer.checkpoint is None or trainer.model_dir is None:
            raise UserError(f"keeping the best checkpoint by {self.metric!r} needs a model_dir; pass one")
        directory = os.path.join(trainer.model_dir, BEST_SUBDIR)
        self._load(directory)
        # Saved with an explicit checkpoint_number: the manager needs no step counter.
        self._manager = tf.train.CheckpointManager(trainer.checkpoint, directory=directory, max_to_keep=1)

    def on_eval_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        value = metric_value(logs, self.metric)
        if not self.watch.improves(value, self.watch.best):
            return
        self.watch.best, self.best_step = value, step
        if not trainer.strategy.extended.should_checkpoint:
            return  # Only the chief writes; every worker tracks the same best.
        assert self._manager is not None, "on_train_begin made it (a chief with a model_dir)"
        # The value first: a crash before the save leaves the older, worse checkpoint
        # recorded as better than it is (it is kept longer), never the reverse.
        model_dir_lib.write_json(
            os.path.join(self._manager.directory, BEST_FILE),
            {
                "metric": self.metric,
                "mode": self.watch.mode,
                "value": value,
                "step": step,
                "checkpoint": f"ckpt-{step}",
            },
        )
        # With a moving average the model is saved holding the averages it was judged by.
        with trainer.averaged_weights():
            path = self._manager.save(checkpoint_number=step)
        logging.info("best eval %s=%.6g at step %d: saved %s", self.metric, value, step, path)

    def _load(self, directory: str) -> None:
        path = os.path.join(directory, BEST_FILE)
        state = model_dir_lib.read_json(path, what="the value of the best checkpoint")
        kept = model_dir_lib.scan_checkpoints(directory)
        if state is None:
            if kept:
                raise UserError(
                    f"{path} is missing but {directory} holds {os.path.basename(kept[-1])}: without its "
                    f"{self.metric} value a worse checkpoint could replace it; restore {BEST_FILE} "
                    f"or move {directory} away"
                )
            return
        value: float | None
        step: int | None
        try:
            metric, mode, value, step = state["metric"], state["mode"], float(state["value"]), int(state["step"])
        except (TypeError, KeyError, ValueError):
            metric = mode = value = step = None
        if value is None or math.isnan(value):
            raise UserError(
                f"{path} is damaged (expected metric, mode, value and step, got "
                f"{str(state)[:100]}); restore it or move {directory} away"
            )
        if (metric, mode) != (self.metric, self.watch.mode):
            raise UserError(
                f"{directory} keeps the best checkpoint by {metric} ({mode}), not by {self.metric} "
                f"({self.watch.mode}); pass --best_checkpoint_metric={metric}, or move {directory} "
                "away to keep a new best"
            )
        self.watch.best, self.best_step = value, step
