"""Forward-pass FLOPs per example, so benchmarks can report achieved FLOP/s
(e.g. model FLOPs utilisation) without a profiler."""

from __future__ import annotations

import math
from typing import cast

import keras
from keras import layers

from engine import compat

_TRANSPOSED_CONVS = (layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)
_SEPARABLE_CONVS = (layers.SeparableConv1D, layers.SeparableConv2D)
_DEPTHWISE_CONVS = (layers.DepthwiseConv1D, layers.DepthwiseConv2D)
_CONVS = (layers.Conv1D, layers.Conv2D, layers.Conv3D)
_COUNTED = (*_TRANSPOSED_CONVS, *_SEPARABLE_CONVS, *_DEPTHWISE_CONVS, *_CONVS, layers.Dense)
# Keras layers whose cost `_layer_macs` may ignore (elementwise, pooling, normalisation, shape and
# dropout layers, Embedding's lookup): a model made of these and the counted kinds only is counted
# exactly enough. Any other layer (a user's own, attention, recurrent) may hide matmuls.
_NEGLIGIBLE = (
    layers.InputLayer,
    layers.Activation,
    layers.ReLU,
    layers.LeakyReLU,
    layers.PReLU,
    layers.ELU,
    layers.Softmax,
    layers.Flatten,
    layers.Reshape,
    layers.Permute,
    layers.RepeatVector,
    layers.Dropout,
    layers.SpatialDropout1D,
    layers.SpatialDropout2D,
    layers.SpatialDropout3D,
    layers.GaussianNoise,
    layers.GaussianDropout,
    layers.BatchNormalization,
    layers.LayerNormalization,
    layers.GroupNormalization,
    layers.UnitNormalization,
    layers.Rescaling,
    layers.Embedding,
    layers.Identity,
    layers.Add,
    layers.Subtract,
    layers.Multiply,
    layers.Average,
    layers.Maximum,
    layers.Minimum,
    layers.Concatenate,
    layers.MaxPooling1D,
    layers.MaxPooling2D,
    layers.MaxPooling3D,
    layers.AveragePooling1D,
    layers.AveragePooling2D,
    layers.AveragePooling3D,
    layers.GlobalMaxPooling1D,
    layers.GlobalMaxPooling2D,
    layers.GlobalMaxPooling3D,
    layers.GlobalAveragePooling1D,
    layers.GlobalAveragePooling2D,
    layers.GlobalAveragePooling3D,
    layers.ZeroPadding1D,
    layers.ZeroPadding2D,
    layers.ZeroPadding3D,
    layers.Cropping1D,
    layers.Cropping2D,
    layers.Cropping3D,
    layers.UpSampling1D,
    layers.UpSampling2D,
    layers.UpSampling3D,
)


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


def _uncounted_layer(model: keras.Model) -> keras.layers.Layer | None:
    """The first layer (in nested models too) whose FLOPs `_layer_macs` neither counts nor may ignore."""
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found = _uncounted_layer(layer)
            if found is not None:
                return found
        elif type(layer) not in _COUNTED + _NEGLIGIBLE:  # Exact types: a subclass may do more.
            return layer
    return None


def known_flops_per_example(model: keras.Model) -> int | None:
    """`flops_per_example(model)` where it counts the model, else None (never a guess).

    Counted: a built functional or Sequential model (nested ones too) made only of the
    layer kinds `_layer_macs` counts and the Keras layers it may ignore, each called once.
    A subclassed model, or one with any other layer (a user's own, attention), is not.
    """
    if not isinstance(model, keras.Model) or not model.built:
        return None
    if type(model) is not keras.Sequential and not compat.is_functional(model):
        return None
    if _uncounted_layer(model) is not None:
        return None
    try:
        flops = flops_per_example(model)
    except (ValueError, TypeError, AttributeError):  # A layer called twice, an unknown shape.
        return None
    return flops or None
