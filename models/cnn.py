"""The CNN of the TensorFlow MNIST tutorial: the project's reference model."""

from __future__ import annotations

import keras
from keras import layers


def build(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Conv(32)-Pool-Conv(64)-Pool-Dense(64)-Dense(num_classes) logits."""
    inputs = keras.Input(shape=input_shape)
    x = layers.Conv2D(32, 3, activation="relu")(inputs)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(64, 3, activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(64, activation="relu")(x)
    # float32 so logits (and the loss) stay float32 under a mixed policy.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")
