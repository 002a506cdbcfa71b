"""Keep the best checkpoint by an eval metric, beside the rolling ones.

`<model_dir>/best` holds one checkpoint (its own `CheckpointManager`,
max_to_keep=1) and `best.json` with the metric, its value and the step, so
a restarted run keeps comparing against the real best rather than
starting over.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Mapping

import tensorflow as tf
from absl import logging

from engine.callbacks import Callback
from engine.errors import UserError
from engine.hooks.metric_watch import MetricWatch, metric_value, write_json

if TYPE_CHECKING:
    from engine.trainer import Trainer

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

    def on_train_begin(self, trainer: "Trainer") -> None:
        if self._manager is not None:
            return
        if trainer.checkpoint_manager is None:
            raise UserError(f"keeping the best checkpoint by {self.metric!r} needs a model_dir; pass one")
        directory = os.path.join(trainer.model_dir, BEST_SUBDIR)
        self._manager = tf.train.CheckpointManager(
            trainer.checkpoint_manager.checkpoint, directory=directory, max_to_keep=1,
            step_counter=trainer.global_step,
        )
        self._load(os.path.join(directory, BEST_FILE))

    def on_eval_end(self, trainer: "Trainer", step: int, logs: Mapping[str, Any]) -> None:
        value = metric_value(logs, self.metric)
        if not self.watch.improves(value, self.watch.best):
            return
        self.watch.best, self.best_step = value, step
        if not trainer.strategy.extended.should_checkpoint:
            return  # Only the chief writes; every worker tracks the same best.
        path = self._manager.save(checkpoint_number=step)
        write_json(os.path.join(self._manager.directory, BEST_FILE), {
            "metric": self.metric, "mode": self.watch.mode, "value": value, "step": step,
            "checkpoint": os.path.basename(path),
        })
        logging.info("best eval %s=%.6g at step %d: saved %s", self.metric, value, step, path)

    def _load(self, path: str) -> None:
        if not os.path.exists(path):
            return
        with open(path) as handle:
            state = json.load(handle)
        if (state.get("metric"), state.get("mode")) != (self.metric, self.watch.mode):
            logging.info("best checkpoint: %s was kept by %s (%s); now keeping by %s (%s)",
                         path, state.get("metric"), state.get("mode"), self.metric, self.watch.mode)
            return
        self.watch.best, self.best_step = float(state["value"]), int(state["step"])
