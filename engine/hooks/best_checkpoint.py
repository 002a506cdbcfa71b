"""Keep the best checkpoint by an eval metric, beside the rolling ones.

`<model_dir>/best` holds one checkpoint and `best.json` with the metric, its
value, the step and the checkpoint's name, so a restarted run keeps
comparing against the real best rather than starting over. The two must
never disagree, whenever the process dies: a new best is written as
`ckpt-N` first, then `best.json` is replaced atomically to name it (the
commit), then best/'s state file names it and the previous checkpoint is
removed. At start `best.json` is the truth: a checkpoint it does not name
was never committed and goes; one it names but best/ lacks (left by an older
version, which wrote `best.json` first) is copied from wherever the model_dir
still holds it, else the record is set aside and the next evaluation sets a
new best, with a warning either way. Without a trustworthy `best.json`
beside a committed best checkpoint (missing, damaged, or kept by another
metric) the run is refused: comparing against nothing would replace the best
with a worse one. With a moving average of the weights (`--ema_decay`) the
saved model holds the averages, which are what the evaluation judged.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from engine import model_dir as model_dir_lib
from engine.callbacks import Callback, TrainerView
from engine.checkpointing import checkpointer as checkpoint_lib
from engine.checkpointing import discovery, repairs
from engine.errors import UserError
from engine.hooks.metric_watch import MetricWatch, metric_value
from engine.logger import logger

BEST_SUBDIR = "best"
BEST_FILE = "best.json"


class BestCheckpoint(Callback):
    """Saves a checkpoint whenever `metric` beats the best evaluation so far."""

    def __init__(self, metric: str, mode: str = "auto", min_delta: float = 0.0):
        self.metric = metric
        self.watch = MetricWatch(metric, mode, min_delta)
        self.best_step: int | None = None
        self._directory: str | None = None

    @property
    def best(self) -> float | None:
        return self.watch.best

    def on_train_begin(self, trainer: TrainerView) -> None:
        self.restore_state(trainer)

    def restore_state(self, trainer: TrainerView) -> None:
        """Reads `best/` (once) and finishes or undoes a save a crash cut short;
        raises UserError when it cannot be trusted. `engine.cli.run.job` calls it before
        writing anything else to the model_dir."""
        if self._directory is not None:
            return
        if trainer.checkpoint is None or trainer.model_dir is None:
            raise UserError(
                f"keeping the best checkpoint by {self.metric!r} needs the Trainer's `model_dir`; pass one"
            )
        directory = os.path.join(trainer.model_dir, BEST_SUBDIR)
        self._load(trainer.model_dir, directory)
        self._directory = directory

    def on_eval_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        value = metric_value(logs, self.metric)
        if not math.isfinite(value):
            logger.warning(
                "eval %s=%s at step %d is not a number to keep a best checkpoint by; the best stays %s",
                self.metric,
                value,
                step,
                "unset" if self.best_step is None else f"step {self.best_step}'s",
            )
            return
        if not self.watch.improves(value, self.watch.best):
            return
        if trainer.strategy.extended.should_checkpoint:  # Only the chief writes; every worker tracks the best.
            assert self._directory is not None and trainer.checkpoint is not None, "on_train_begin: a chief"
            name = f"ckpt-{step}"
            _remove_checkpoint(self._directory, name)  # Never committed (the reconcile at start removes it too).
            # With a moving average the model is saved holding the averages it was judged by.
            prefix = os.path.join(self._directory, name)
            # A save that fails (a full disk) removes its partial folder, best/ckpt-N_temp.
            with trainer.averaged_weights(), discovery.partial_removed_on_error(prefix):
                trainer.checkpoint.write(prefix)
            record = {
                "metric": self.metric,
                "mode": self.watch.mode,
                "value": value,
                "step": step,
                "checkpoint": name,
            }
            model_dir_lib.write_json(os.path.join(self._directory, BEST_FILE), record)  # The commit.
            _keep_only(self._directory, name)
            logger.info("best eval %s=%.6g at step %d: saved %s", self.metric, value, step, name)
        # Only now: a save that failed (a full disk, an evaluator's checkpoint rotated away) keeps the old best.
        self.watch.best, self.best_step = value, step

    def _load(self, model_dir: str, directory: str) -> None:
        path = os.path.join(directory, BEST_FILE)
        state = model_dir_lib.read_json(path, what="the value of the best checkpoint")
        kept = discovery.scan_checkpoints(directory)
        if state is None:
            committed = _committed(directory)
            if committed:
                raise UserError(
                    f"{path} is missing but {directory} holds {committed}: without its "
                    f"{self.metric} value a worse checkpoint could replace it; restore {BEST_FILE} "
                    f"or move {directory} away"
                )
            for uncommitted in kept:  # A first best cut short before its best.json: never committed.
                _remove_checkpoint(directory, os.path.basename(uncommitted))
            return
        value: float | None
        step: int | None
        try:
            metric, mode, value, step = state["metric"], state["mode"], float(state["value"]), int(state["step"])
            name = str(state.get("checkpoint", f"ckpt-{step}"))
        except (TypeError, KeyError, ValueError):
            metric = mode = value = step = None
            name = ""
        if value is not None and not math.isfinite(value):
            # Written by hand or by someone else: the engine keeps only finite bests. A best of
            # -Infinity (by a max metric) would never be beaten, so no later best would be kept.
            raise UserError(
                f"{path} is damaged: its value {state.get('value')!r} is not a finite number, and no "
                f"evaluation could beat it; restore it or move {directory} away"
            )
        if value is None or not _CHECKPOINT_NAME.match(name):
            raise UserError(
                f"{path} is damaged (expected metric, mode, value, step and checkpoint, got "
                f"{str(state)[:100]}); restore it or move {directory} away"
            )
        if (metric, mode) != (self.metric, self.watch.mode):
            raise UserError(
                f"{directory} keeps the best checkpoint by {metric} ({mode}), not by {self.metric} "
                f"({self.watch.mode}); pass `BestCheckpoint(metric={metric!r})`, or move {directory} "
                "away to keep a new best"
            )
        if not _readable(os.path.join(directory, name)) and not _copy_from_elsewhere(model_dir, directory, name):
            aside = _set_aside(directory)
            logger.warning(
                "%s names %s, which %s does not hold and the model_dir has nowhere else (left by a crash "
                "of an older version); moved the record and the checkpoint beside it to %s: the next "
                "evaluation sets a new best",
                path,
                name,
                directory,
                aside,
            )
            return
        _keep_only(directory, name)
        self.watch.best, self.best_step = value, step


_CHECKPOINT_NAME = re.compile(r"^ckpt-\d+$")


def _readable(prefix: str) -> bool:
    return tf.io.gfile.exists(prefix + ".index") and discovery.read_problem(prefix) is None


def _committed(directory: str) -> str | None:
    """The checkpoint best/'s state file names: written only after `best.json` named it."""
    state = discovery.checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return None
    return os.path.basename(state.model_checkpoint_path)


def _files_of(directory: str, name: str) -> list[str]:
    if not tf.io.gfile.isdir(directory):
        return []
    return [f for f in tf.io.gfile.listdir(directory) if f.startswith(name + ".")]  # Listed, not globbed.


def _remove_checkpoint(directory: str, name: str) -> None:
    for file in _files_of(directory, name):
        repairs.remove(os.path.join(directory, file))


def _keep_only(directory: str, name: str) -> None:
    """Makes best/'s state file name `name` alone (relative: the model_dir may move),
    then removes every other checkpoint there: the end of a save, finished."""
    if _committed(directory) != name or len(discovery.scan_checkpoints(directory)) > 1:
        discovery.write_state(directory, name, [name])
    for other in discovery.scan_checkpoints(directory):
        if os.path.basename(other) != name:
            _remove_checkpoint(directory, os.path.basename(other))


def _copy_from_elsewhere(model_dir: str, directory: str, name: str) -> bool:
    """Copies `name` into best/ from another directory of the model_dir (the rolling
    checkpoints keep the same step) if it is readable there; whether it did.

    Not with a moving average: the rolling checkpoint holds the trained weights,
    the best one the averages that were evaluated."""
    if checkpoint_lib.recorded_settings(model_dir).get("ema_decay", "0.0") not in ("0", "0.0"):
        return False
    for root, _, files in tf.io.gfile.walk(model_dir):
        if root.rstrip("/") == directory.rstrip("/") or name + ".index" not in files:
            continue
        if not _readable(os.path.join(root, name)):
            continue
        _remove_checkpoint(directory, name)  # A damaged copy of an older version's.
        for file in _files_of(root, name):
            repairs.copy(os.path.join(root, file), os.path.join(directory, file))
        logger.warning(
            "%s named %s but %s did not hold it (left by a crash of an older version); copied it from %s",
            os.path.join(directory, BEST_FILE),
            name,
            directory,
            root,
        )
        return True
    return False


def _set_aside(directory: str) -> str:
    """Moves best.json and best/'s checkpoints (a record that lies, and a checkpoint of
    unknown value) to `best/superseded/<time>/`: nothing is deleted."""
    aside = os.path.join(directory, model_dir_lib.SUPERSEDED_SUBDIR, time.strftime("%Y%m%dT%H%M%S"))
    repairs.makedirs(aside)
    for file in tf.io.gfile.listdir(directory):
        if file == BEST_FILE or file == model_dir_lib.STATE_FILE or file.startswith("ckpt-"):
            repairs.rename(os.path.join(directory, file), os.path.join(aside, file))
    return aside
