"""A small CIFAR-style ResNet (He et al. 2016, section 4.2) for 28x28/32x32
inputs: a model with BatchNorm, whose moving statistics exercise the engine's
handling of non-trainable state under tf.distribute.

BatchNorm momentum is 0.9, not Keras's 0.99: runs here are a few hundred
steps, and with 0.99 the moving statistics still lag the weights then, so
evaluation (which uses them) scored ~11% after 200 steps, with `model.fit`
as with the engine."""

from __future__ import annotations

import keras
from keras import layers

STAGE_FILTERS = (16, 32, 64)


def _block(x: keras.KerasTensor, filters: int, stride: int) -> keras.KerasTensor:
    """Two 3x3 convs with a projection shortcut when the shape changes."""
    shortcut = x
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = layers.BatchNormalization(momentum=0.9)(y)
    y = layers.Activation("relu")(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = layers.BatchNormalization(momentum=0.9)(y)
    if stride != 1 or x.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
        shortcut = layers.BatchNormalization(momentum=0.9)(shortcut)
    return layers.Activation("relu")(layers.Add()([y, shortcut]))


def build(input_shape: tuple[int, ...], num_classes: int, blocks_per_stage: int = 1) -> keras.Model:
    """ResNet-(6n+2) with n = blocks_per_stage; the registry uses n=1 (ResNet-8)
    so that it trains in seconds on a CPU. n=3 gives ResNet-20."""
    if blocks_per_stage < 1:
        raise ValueError(
            f"blocks_per_stage must be >= 1, got {blocks_per_stage}; use 1 for ResNet-8, 3 for ResNet-20"
        )
    inputs = keras.Input(shape=input_shape)
    x = layers.Conv2D(STAGE_FILTERS[0], 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization(momentum=0.9)(x)
    x = layers.Activation("relu")(x)
    for stage, filters in enumerate(STAGE_FILTERS):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _block(x, filters, stride)
    x = layers.GlobalAveragePooling2D()(x)
    # float32 so logits (and the loss) stay float32 under a mixed policy.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=f"resnet{6 * blocks_per_stage + 2}")
