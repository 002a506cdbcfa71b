"""Watching one eval metric: which direction is better, the best value so
far, and how many evaluations have passed without improvement.

Shared by early stopping, best-checkpoint and plateau hooks so that they
agree on what "better" means. Decisions depend only on the sequence of eval
values, which the engine all-reduces over every replica and worker: every
worker sees the same values and so takes the same decisions, with no extra
communication.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from engine import model_dir as model_dir_lib
from engine.callbacks import Callback, TrainerView
from engine.errors import UserError
from engine.logger import logger
from engine.options import METRIC_MODES as MODES

# Metrics where larger is better; anything else (losses, errors) is minimized under "auto".
_MAX_HINTS = ("acc", "auc", "precision", "recall", "f1", "iou", "top", "r2")
STATE_SUBDIR = "hooks"


def resolve_mode(metric: str, mode: str) -> str:
    """'min' or 'max' for `metric`; 'auto' picks max for accuracy-like names."""
    if mode not in MODES:
        raise UserError(f"unknown mode {mode!r} for metric {metric!r}; choose one of: {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "max" if any(hint in metric.lower() for hint in _MAX_HINTS) else "min"


def metric_value(logs: Mapping[str, Any], metric: str) -> float:
    if metric not in logs:
        raise UserError(f"eval metric {metric!r} is not reported; choose one of: {', '.join(sorted(logs))}")
    return float(logs[metric])


class MetricWatch:
    """Best value and evaluations since the last improvement of one metric."""

    def __init__(self, metric: str, mode: str = "auto", min_delta: float = 0.0):
        if min_delta < 0:
            raise UserError(f"`min_delta={min_delta}` must not be negative")
        self.metric = metric
        self.mode = resolve_mode(metric, mode)
        self.min_delta = min_delta
        self.best: float | None = None
        self.wait = 0

    def improves(self, value: float, reference: float | None) -> bool:
        """Whether `value` beats `reference` (None: nothing yet). A NaN or infinite value never
        does: a diverged evaluation is not a best checkpoint, nor the bar later ones must beat
        (NaN compares false with everything, so it would stay the best forever)."""
        if not math.isfinite(value):
            return False
        if reference is None:
            return True
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    def update(self, value: float) -> bool:
        """Records one evaluation; True when it improved on the best."""
        if self.improves(value, self.best):
            self.best, self.wait = value, 0
            return True
        self.wait += 1
        return False


class PatienceHook(Callback):
    """A hook that acts when `patience` evaluations pass without improvement.

    Its state is a pure function of the metric's history, which is kept in
    `<model_dir>/hooks/<name>.json`. On a restart the history is cut back to
    the restored step and replayed, so the hook continues exactly as if the
    run had not stopped (evaluations after the restored checkpoint are
    redone, not double counted).
    """

    name = "patience"

    def __init__(self, metric: str, *, patience: int, mode: str = "auto", min_delta: float = 0.0):
        if patience < 1:
            raise UserError(f"`patience={patience}` for metric {metric!r} must be at least 1")
        self.metric = metric
        self.patience = patience
        self._mode, self._min_delta = mode, min_delta
        self.watch = MetricWatch(metric, mode, min_delta)
        self.history: list[tuple[int, float]] = []
        self._path: str | None = None
        self._writes = True

    # Subclasses act here; `replaying` is True while rebuilding state after a restart.
    def on_patience_exhausted(self, trainer: TrainerView, step: int, replaying: bool) -> None:
        raise NotImplementedError

    def restore_state(self, trainer: TrainerView) -> None:
        """Reads `hooks/<name>.json` (once); a damaged file is a UserError.
        `engine.cli.run.job` calls it before writing anything to the model_dir."""
        model_dir = trainer.model_dir
        if model_dir and self._path is None:
            self._path = os.path.join(model_dir, STATE_SUBDIR, f"{self.name}.json")
            self.history = self._load(self._path)

    def on_train_begin(self, trainer: TrainerView) -> None:
        self.restore_state(trainer)
        self._writes = trainer.strategy.extended.should_checkpoint  # The chief writes; all replay.
        self.history = [(s, v) for s, v in self.history if s <= trainer.step]
        self.watch = MetricWatch(self.metric, self._mode, self._min_delta)
        for step, value in self.history:
            self._observe(trainer, step, value, replaying=True)

    def on_eval_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        value = metric_value(logs, self.metric)
        self.history = [(s, v) for s, v in self.history if s < step] + [(step, value)]
        self._save()
        self._observe(trainer, step, value, replaying=False)

    def _observe(self, trainer: TrainerView, step: int, value: float, *, replaying: bool) -> None:
        self.watch.update(value)
        if self.watch.wait >= self.patience:
            self.on_patience_exhausted(trainer, step, replaying)

    def _load(self, path: str) -> list[tuple[int, float]]:
        state = model_dir_lib.read_json(path, what=f"the eval history of {self.name}")
        if state is None:
            return []
        try:
            metric = state["metric"]
            history = [(int(s), float(v)) for s, v in state["history"]]
        except (TypeError, KeyError, ValueError):
            history = None
        if history is None or any(math.isnan(v) for _, v in history):
            raise UserError(
                f"{path} is damaged (expected a metric and a history of [step, value]); "
                "restore it or move it away"
            )
        if metric != self.metric:
            logger.info("%s: ignoring %s, it watched %r, not %r", self.name, path, metric, self.metric)
            return []
        return history

    def _save(self) -> None:
        if not self._path or not self._writes:
            return
        model_dir_lib.write_json(self._path, {"metric": self.metric, "history": self.history})
