"""Tables standardized inside the model: each feature column by the training split's mean and
standard deviation, and a regression's outputs scaled back to its labels' (`--normalize`).

Inside the model, so that evaluation, predict and the exported SavedModel apply the same
statistics, which the checkpoints hold. Not `keras.layers.Normalization`: it computes with
tensors taken from its weights when adapted or built, so a `tf.train.Checkpoint` restore
changes its weights but not what it computes (predict from a model_dir would use a mean of 0
and a variance of 1). `Standardization` reads its weights each time it is called.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops


@keras.saving.register_keras_serializable(package="engine")
class Standardization(keras.layers.Layer):
    """(x - mean) / scale per column of the last axis; with `inverse`, y * scale + mean."""

    def __init__(self, inverse: bool = False, **kwargs: Any):
        kwargs.setdefault("dtype", "float32")  # Statistics and outputs in float32 under a mixed policy.
        super().__init__(**kwargs)
        self.inverse = inverse

    def build(self, input_shape: Any) -> None:
        columns = (int(input_shape[-1]),)
        self.mean = self.add_weight(name="mean", shape=columns, initializer="zeros", trainable=False)
        self.scale = self.add_weight(name="scale", shape=columns, initializer="ones", trainable=False)

    def call(self, inputs: Any) -> Any:
        inputs = ops.cast(inputs, self.compute_dtype)
        if self.inverse:
            return inputs * self.scale + self.mean
        return (inputs - self.mean) / self.scale

    def set_statistics(self, values: np.ndarray) -> None:
        """The mean and scale of `values` (examples, columns), taken in float64; a constant column
        keeps a scale of 1 (its values all become 0)."""
        values = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
        std = values.std(axis=0)
        self.mean.assign(values.mean(axis=0).astype(np.float32))
        self.scale.assign(np.where(std > 0, std, 1.0).astype(np.float32))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "inverse": self.inverse}


def standardized(model: keras.Model, input_shape: tuple[int, ...], *, outputs_too: bool) -> keras.Model:
    """`model` behind a `Standardization` of its inputs (named "standardize_features") and, with
    `outputs_too` (a regression of one output), followed by the inverse one ("scale_outputs").
    `set_table_statistics` fills them from the training split."""
    inputs = keras.Input(shape=input_shape)
    outputs = model(Standardization(name="standardize_features")(inputs))
    if outputs_too:
        outputs = Standardization(inverse=True, name="scale_outputs")(outputs)
    return keras.Model(inputs, outputs, name=model.name)


def set_table_statistics(model: keras.Model, features: np.ndarray, labels: np.ndarray | None) -> None:
    """Fills the layers `standardized` added with the training split's statistics."""
    model.get_layer("standardize_features").set_statistics(features)
    if labels is not None:
        model.get_layer("scale_outputs").set_statistics(labels)
