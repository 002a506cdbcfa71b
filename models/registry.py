"""Name -> model builder table, so the engine picks a model by a flag value.

Besides the built-in names, `--model=package.module:function` names the
user's own builder, `function(input_shape, num_classes) -> keras.Model`
returning float32 logits: it is imported (from the working directory or
the Python path) and trained like the built-in models.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import keras

from engine.user_code import UserCodeError, import_callable, signature_text
from models import cnn, mlp, resnet, resnet50, wide_deep, wide_mlp


class ModelError(ValueError):
    """A --model value that names no model, or a user builder that cannot be
    used; the message is one user-facing line."""


# The input shape a user's builder receives: the one the built-in data sets
# (digits, mnist, synthetic) are served at for the small built-in models.
USER_MODEL_INPUT_SHAPE = (28, 28, 1)  # digits, mnist and synthetic only: other data at its own.


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model; building is deferred so that the engine can do it
    inside `strategy.scope()` and under the mixed-precision policy it chose."""

    name: str
    # (input_shape, num_classes) -> uncompiled model that outputs float32 logits.
    build: Callable[[tuple[int, ...], int], keras.Model]
    default_input_shape: tuple[int, ...]
    description: str
    # Settings (`engine.cli.config.settings`) the builder takes as keyword arguments when given.
    keywords: tuple[str, ...] = ()


_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("cnn", cnn.build, (28, 28, 1), "MNIST-tutorial CNN: 2 conv + 2 dense layers"),
        ModelSpec("mlp", mlp.build, (28, 28, 1), "one hidden layer of 128 units"),
        ModelSpec(
            "resnet", resnet.build, (28, 28, 1), "ResNet-8 (CIFAR style, 3 stages of 1 block) with BatchNorm"
        ),
        ModelSpec(
            "resnet50",
            resnet50.build,
            (224, 224, 3),
            "Keras ResNet50, random weights; throughput benchmarks only",
        ),
        ModelSpec(
            "wide_deep",
            wide_deep.build,
            (wide_deep.NUM_DENSE + wide_deep.NUM_IDS,),
            "wide & deep over --dataset=clicks: two --vocab_size-id tables (100,000) in 4 shards each "
            "(parameter servers)",
            keywords=("vocab_size",),
        ),
        ModelSpec(
            "wide_mlp", wide_mlp.build, (28, 28, 1), "3 dense layers of 4096 units; matmul-heavy benchmark"
        ),
    )
}


def model_names() -> list[str]:
    """Registered model names, in registration order (for flag help and errors)."""
    return list(_SPECS)


def is_user_model(name: str) -> bool:
    """Whether `name` is `package.module:function` rather than a built-in name."""
    return ":" in name


def get_model_spec(name: str) -> ModelSpec:
    """Look up a model by its flag value; a user's builder is imported here,
    so that a bad one is reported before anything else happens."""
    if is_user_model(name):
        return _user_model_spec(name)
    try:
        return _SPECS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; choose one of: {', '.join(_SPECS)}") from None


def _user_model_spec(name: str) -> ModelSpec:
    try:
        function, where = import_callable(
            name,
            setting="model",
            example="my_models:build",
            signature="(input_shape, num_classes) -> keras.Model",
        )
    except UserCodeError as error:
        raise ModelError(str(error)) from None
    function_name = name.partition(":")[2]
    try:
        inspect.signature(function).bind(USER_MODEL_INPUT_SHAPE, 10)
    except TypeError:
        raise ModelError(
            f"--model={name}: {function_name}{signature_text(function)} ({where}) cannot be called as "
            f"{function_name}(input_shape, num_classes); give it those two parameters"
        ) from None
    except ValueError:  # No signature to inspect (a builtin): calling it tells.
        pass

    def build(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
        model = function(input_shape, num_classes)
        _check_user_model(name, model, num_classes)
        return model

    return ModelSpec(name, build, USER_MODEL_INPUT_SHAPE, f"{function_name} from {where}")


def _check_user_model(name: str, model, num_classes: int) -> None:
    """Refuses what would train silently wrong: the engine's loss takes logits of num_classes."""
    if not isinstance(model, keras.Model):
        raise ModelError(
            f"--model={name} returned {type(model).__module__}.{type(model).__name__}, "
            "not a keras.Model; return an (uncompiled) keras.Model"
        )
    if getattr(model, "compiled", False):  # Its compile() settings would conflict with the flags'.
        raise ModelError(
            f"--model={name} returned a compiled model; return it uncompiled: the flags set its optimizer "
            "(--optimizer, --learning_rate), loss and metrics (--metrics)"
        )
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # A subclassed model: no symbolic outputs to check.
        return
    if outputs and len(outputs) == 1 and outputs[0].shape[-1] not in (None, num_classes):
        raise ModelError(
            f"--model={name} outputs shape {tuple(outputs[0].shape)}; the data's labels need "
            f"{num_classes} outputs: end with a Dense({num_classes})"
        )
    last = model.layers[-1] if model.layers else None
    if isinstance(last, keras.layers.Softmax) or getattr(last, "activation", None) is keras.activations.softmax:
        raise ModelError(
            f"--model={name} ends with a softmax; the engine's loss takes logits "
            "(from_logits=True): drop the softmax from the last layer"
        )
