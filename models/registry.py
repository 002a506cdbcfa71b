"""Name -> model builder table, so the engine picks a model by a flag value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import keras

from models import cnn, mlp, resnet, resnet50, wide_mlp


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model; building is deferred so that the engine can do it
    inside `strategy.scope()` and under the mixed-precision policy it chose."""

    name: str
    # (input_shape, num_classes) -> uncompiled model that outputs float32 logits.
    build: Callable[[tuple[int, ...], int], keras.Model]
    default_input_shape: tuple[int, ...]
    description: str


_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("cnn", cnn.build, (28, 28, 1),
                  "MNIST-tutorial CNN: 2 conv + 2 dense layers"),
        ModelSpec("mlp", mlp.build, (28, 28, 1),
                  "one hidden layer of 128 units"),
        ModelSpec("resnet", resnet.build, (28, 28, 1),
                  "ResNet-8 (CIFAR style, 3 stages of 1 block) with BatchNorm"),
        ModelSpec("resnet50", resnet50.build, (224, 224, 3),
                  "Keras ResNet50, random weights; throughput benchmarks only"),
        ModelSpec("wide_mlp", wide_mlp.build, (28, 28, 1),
                  "3 dense layers of 4096 units; matmul-heavy benchmark"),
    )
}


def model_names() -> list[str]:
    """Registered model names, in registration order (for flag help and errors)."""
    return list(_SPECS)


def get_model_spec(name: str) -> ModelSpec:
    """Look up a model by its flag value."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(_SPECS)}"
        ) from None
