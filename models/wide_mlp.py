"""Three 4096-wide dense layers: a matmul-bound workload for throughput
benchmarks, where the input pipeline and per-step overhead are negligible."""

from __future__ import annotations

import keras
from keras import layers

WIDTH = 4096
DEPTH = 3


def build(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Flatten-Dense(4096, relu)x3-Dense(num_classes) logits."""
    inputs = keras.Input(shape=input_shape)
    x = layers.Flatten()(inputs)
    for _ in range(DEPTH):
        x = layers.Dense(WIDTH, activation="relu")(x)
    # float32 so logits (and the loss) stay float32 under a mixed policy.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="wide_mlp")
