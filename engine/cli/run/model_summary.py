"""The model's description for the start-up log: Keras's `model.summary()`
(layers, output shapes, "Total params"), or for a `tf.Module` its variables
and their count, which is what a `fit` user reads before training starts."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf


def model_summary(model: Any) -> str:
    if isinstance(model, keras.Model):
        parts: list[str] = []
        model.summary(print_fn=lambda text, line_break=False: parts.append(text))
        return "\n".join(part.rstrip("\n") for part in parts)
    variables = _module_variables(model)
    lines = [f"{type(model).__name__} (tf.Module): {len(variables)} variables"]
    names = [getattr(v, "path", None) or v.name.split(":")[0] for v in variables]  # Keras weights: their path.
    width = max(map(len, names), default=0)
    for name, variable in zip(names, variables, strict=True):
        lines.append(f"  {name:<{width}}  {str(tuple(variable.shape)):<16} {tf.as_dtype(variable.dtype).name}")
    total = sum(int(np.prod(v.shape)) for v in variables)
    trainable = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
    lines.append(f" Total params: {total:,} (trainable: {trainable:,})")
    return "\n".join(lines)


def _module_variables(module: Any) -> list:
    """A tf.Module's variables, including those of Keras layers it holds, which
    `tf.Module.variables` does not see under Keras 3."""
    found, seen = [], set()
    for variable in list(module.variables) + [w for layer in _keras_layers(module) for w in layer.weights]:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def _keras_layers(module: Any) -> list[keras.layers.Layer]:
    return [value for value in vars(module).values() if isinstance(value, keras.layers.Layer)]
