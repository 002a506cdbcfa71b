"""The compiled train loop's graph, written once for TensorBoard's Graphs tab.

TensorFlow records function graphs only while they are traced, so tracing
is switched on before the first loop and the graph exported after it. The
loop is traced once per trainer (its length is a tensor), so the graph is
written once: a second `train()` call writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from engine.callbacks import Callback, TrainerView
from engine.errors import one_line
from engine.logger import logger

GRAPH_NAME = "train_loop"
# What a remote task that died or is restarting makes an export fail with.
_PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError)


class TrainGraph(Callback):
    """Writes the train loop's graph to the `train` run at the first loop's step."""

    def __init__(self) -> None:
        self._tracing = False
        self._written = False  # One hook per trainer: its first loop traced the train loop.

    def on_train_begin(self, trainer: TrainerView) -> None:
        if trainer.model_dir is None or self._written:
            return
        tf.summary.trace_on(graph=True, profiler=False)
        self._tracing = True

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        if not self._tracing:
            return
        self._tracing, self._written = False, True
        writer = trainer.summaries.writer("train")
        assert writer is not None, "tracing starts only with a model_dir"
        try:
            with writer.as_default(step=step):
                tf.summary.trace_export(GRAPH_NAME)
        except _PEER_FAILURES as error:
            # Exporting gathers run metadata from every task: under parameter-server training a
            # worker that just died fails it, and the run (which survives the worker) must not die
            # for a TensorBoard picture.
            tf.summary.trace_off()
            logger.warning("train loop graph not written to TensorBoard: %s", one_line(error, 300))
            return
        writer.flush()

    def on_train_end(self, trainer: TrainerView, logs: Mapping[str, Any]) -> None:
        if self._tracing:  # No loop ran.
            self._tracing = False
            tf.summary.trace_off()
