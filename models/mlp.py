"""A one-hidden-layer perceptron: the cheapest model, for smoke tests."""

from __future__ import annotations

import keras
from keras import layers


def build(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Flatten-Dense(128, relu)-Dense(num_classes) logits."""
    inputs = keras.Input(shape=input_shape)
    x = layers.Flatten()(inputs)
    x = layers.Dense(128, activation="relu")(x)
    # float32 so logits (and the loss) stay float32 under a mixed policy.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")
