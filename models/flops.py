"""Forward-pass FLOPs per example, so benchmarks can report achieved FLOP/s
(e.g. model FLOPs utilisation) without a profiler."""

from __future__ import annotations

import math
from typing import cast

import keras
from keras import layers

_TRANSPOSED_CONVS = (layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)
_SEPARABLE_CONVS = (layers.SeparableConv1D, layers.SeparableConv2D)
_DEPTHWISE_CONVS = (layers.DepthwiseConv1D, layers.DepthwiseConv2D)
_CONVS = (layers.Conv1D, layers.Conv2D, layers.Conv3D)


def _spatial_size(shape: tuple[int | None, ...], data_format: str) -> int:
    """Number of output positions of a conv (its shape without batch and channels)."""
    spatial = shape[1:-1] if data_format == "channels_last" else shape[2:]
    return math.prod(cast(tuple[int, ...], spatial))  # Built: only the batch dimension is None.


def _size(variable: keras.Variable) -> int:
    """Number of weights; counts in/out channels and groups in one go."""
    return math.prod(variable.shape)


def _called_shape(layer: keras.layers.Layer, which: str) -> tuple[int | None, ...]:
    """Input or output shape of the layer's single call in the model graph."""
    try:
        return tuple(getattr(layer, which).shape)
    except (AttributeError, ValueError) as err:
        # `layer.input`/`layer.output` exist only for a layer called exactly once.
        raise ValueError(
            f"cannot count FLOPs of layer {layer.name!r} ({type(layer).__name__}): "
            f"{err}; flops_per_example needs a built functional model whose "
            "layers are each called once"
        ) from err


def _layer_macs(layer: keras.layers.Layer) -> int:
    """Multiply-accumulates of one call of `layer` on one example.

    Every handled kind costs (number of positions the kernel is applied at) x
    (kernel size), where kernel size already includes in/out channels and
    groups. Biases, activations, pooling, BatchNorm and other elementwise ops
    are ignored: they are a few percent at most for these models.
    """
    if isinstance(layer, _TRANSPOSED_CONVS):
        # Each input position is scattered through the whole kernel.
        positions = _spatial_size(_called_shape(layer, "input"), layer.data_format)
        return positions * _size(layer.kernel)
    if isinstance(layer, _SEPARABLE_CONVS):
        positions = _spatial_size(_called_shape(layer, "output"), layer.data_format)
        kernel_size = _size(layer.depthwise_kernel) + _size(layer.pointwise_kernel)
        return positions * kernel_size
    if isinstance(layer, _DEPTHWISE_CONVS + _CONVS):
        positions = _spatial_size(_called_shape(layer, "output"), layer.data_format)
        return positions * _size(layer.kernel)
    if isinstance(layer, layers.Dense):
        # A Dense on a rank>2 input applies its kernel at every leading position.
        positions = math.prod(cast(tuple[int, ...], _called_shape(layer, "output")[1:-1]))  # Batch: [0].
        return positions * _size(layer.kernel)
    return 0


def _model_macs(model: keras.Model) -> int:
    """Sum over layers, descending into nested models."""
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            total += _model_macs(layer)
            continue
        total += _layer_macs(layer)
    return total


def flops_per_example(model: keras.Model) -> int:
    """Forward-pass FLOPs (2 x multiply-accumulates) of one example.

    Counts Conv (incl. depthwise, separable, transposed) and Dense layers from
    their weights and output shapes; see `_layer_macs` for what is ignored.
    Training costs about 3x this (forward + two backward matmuls).
    """
    if not model.built:
        raise ValueError(
            f"model {model.name!r} is not built; build it with an explicit "
            "keras.Input (as models/ does) before counting FLOPs"
        )
    return 2 * _model_macs(model)
