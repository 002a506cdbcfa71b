"""Keras' ResNet50 with random weights: the standard throughput benchmark."""

from __future__ import annotations

import keras
from keras import layers


def build(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """ResNet50 backbone (weights=None: never downloads) plus our own head.

    The head is built here, not by `ResNet50(classes=...)`, because the stock
    "predictions" layer follows the global dtype policy, so its logits would be
    bfloat16/float16 under a mixed policy; this one is the same
    GlobalAveragePooling + Dense, computed in float32.
    """
    inputs = keras.Input(shape=input_shape)
    backbone = keras.applications.ResNet50(include_top=False, weights=None, input_tensor=inputs, pooling="avg")
    outputs = layers.Dense(num_classes, dtype="float32", name="predictions")(backbone.output)
    return keras.Model(inputs, outputs, name="resnet50")
