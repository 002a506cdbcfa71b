"""The compiled train loop's graph, written once for TensorBoard's Graphs tab.

TensorFlow records function graphs only while they are traced, so tracing
is switched on before the first loop and the graph exported after it; a
train loop traced earlier (a second `train()` call) is not written again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import tensorflow as tf

from engine.callbacks import Callback

if TYPE_CHECKING:
    from engine.trainer import Trainer

GRAPH_NAME = "train_loop"


class TrainGraph(Callback):
    """Writes the train loop's graph to the `train` run at the first loop's step."""

    def __init__(self) -> None:
        self._tracing = False

    def on_train_begin(self, trainer: "Trainer") -> None:
        if trainer.model_dir is None or trainer.train_loop.experimental_get_tracing_count():
            return
        tf.summary.trace_on(graph=True, profiler=False)
        self._tracing = True

    def on_loop_end(self, trainer: "Trainer", step: int, logs: Mapping[str, Any]) -> None:
        if not self._tracing:
            return
        self._tracing = False
        writer = trainer.summaries.writer("train")
        with writer.as_default(step=step):
            tf.summary.trace_export(GRAPH_NAME)
        writer.flush()

    def on_train_end(self, trainer: "Trainer", logs: Mapping[str, Any]) -> None:
        if self._tracing:  # No loop ran.
            self._tracing = False
            tf.summary.trace_off()
