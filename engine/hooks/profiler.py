"""`--profile_steps=START,END`: a profiler trace of the steps from START to END.

Loops are cut at START and END (`loop_limit`), so the trace covers exactly
the steps that take the global step from START to END, and tracing never
runs inside a loop it was not meant for. The trace goes to
`<model_dir>/train/plugins/profile/<time>/`, where TensorBoard's Profile tab
(the `tensorboard-plugin-profile` package) finds it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from engine.callbacks import Callback, TrainerView
from engine.errors import UserError
from engine.logger import logger


class ProfileWindow(Callback):
    """Runs `tf.profiler.experimental` while the global step goes from `start` to `end`."""

    def __init__(self, start: int, end: int, logdir: str | None = None):
        if not 0 <= start < end:
            raise UserError(f"profile window {start},{end} must satisfy 0 <= START < END")
        self.start, self.end = start, end
        self._logdir = logdir
        self._active = False

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        if step < self.start:
            return self.start - step
        if step < self.end:
            return self.end - step
        return None

    def on_train_begin(self, trainer: TrainerView) -> None:
        if self._logdir is None:
            if trainer.model_dir is None:
                raise UserError("profiling needs a model_dir to write the trace to; pass one")
            self._logdir = os.path.join(trainer.model_dir, "train")
        self._maybe_start(trainer.step)

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        if self._active and step >= self.end:
            self._stop(step)
        self._maybe_start(step)

    def on_train_end(self, trainer: TrainerView, logs: Mapping[str, Any]) -> None:
        if self._active:  # Training ended (or was stopped) inside the window.
            self._stop(trainer.step)

    def _maybe_start(self, step: int) -> None:
        if not self._active and self.start <= step < self.end:
            tf.profiler.experimental.start(self._logdir)
            self._active = True
            logger.info("profiler: tracing from step %d to %d into %s", step, self.end, self._logdir)

    def _stop(self, step: int) -> None:
        tf.profiler.experimental.stop()
        self._active = False
        logger.info("profiler: trace written at step %d (TensorBoard's Profile tab)", step)
