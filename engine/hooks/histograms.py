"""`--histogram_every=N`: histograms of every weight in TensorBoard's `train`
run every N steps (the Histograms and Distributions tabs), as Keras's
`TensorBoard(histogram_freq=...)` gives `fit` users, and the global gradient
norm: the standard step then returns `grad_norm`, written with the other
train scalars (the mean over each compiled loop).

They are written on the host between compiled loops, which are cut at the
multiples of N (`loop_limit`): the loop is neither retraced nor slowed
between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from engine.callbacks import Callback, TrainerView
from engine.errors import UserError


class WeightHistograms(Callback):
    """Writes a histogram of each of the model's weights at every multiple of `every` steps."""

    needs_grad_norm = True

    def __init__(self, every: int):
        if every < 1:
            raise UserError(f"`WeightHistograms(every={every})` must be at least 1 (steps)")
        self.every = every

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        return self.every - step % self.every

    def on_loop_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None:
        if step % self.every:
            return
        writer = trainer.summaries.writer("train")
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in model_weights(trainer.model):
                tf.summary.histogram(name, value)
        writer.flush()


def model_weights(model: Any) -> list[tuple[str, tf.Tensor]]:
    """(name, value) of every weight, trainable or not: Keras paths for a Keras
    model, variable names for a `tf.Module`."""
    if isinstance(model, keras.Model):
        return [(weight.path, tf.convert_to_tensor(weight)) for weight in model.weights]
    return [(variable.name.split(":")[0], tf.convert_to_tensor(variable)) for variable in model.variables]
