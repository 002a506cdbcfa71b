"""Whether a built model fits the data it is about to train on.

Checked symbolically (no variable is touched, no step is traced) right after
the model is built and before anything is written to the model_dir: a model
whose input or output does not match the data would otherwise fail deep in
the first traced step, after the run has written its settings and event files.
"""

from __future__ import annotations

from typing import Any

import keras

from models.registry import ModelError


def check_fits_data(
    name: str,
    model: keras.Model,
    input_shape: tuple[int, ...],
    num_outputs: int,
    element_shape: tuple[int, ...] = (),
) -> int:
    """Raises ModelError naming both shapes when `model` cannot take batches of examples of
    `input_shape` or does not return (batch, *element_shape, num_outputs) tensors (logits or
    values; `element_shape` is (T,) for a class id per element, a tag per token); returns
    how many such outputs it has (several: each is trained against the same labels).

    A model that is not built yet (a subclassed model never called) has no
    variables to train; the Trainer refuses it with its own message.
    """
    if not model.built:
        return 1
    data = (None, *input_shape)
    declared = _declared_input_shapes(model)
    if declared is not None:
        if len(declared) != 1:
            raise ModelError(
                f"--model={name} takes {len(declared)} inputs {declared}; the data gives one: "
                f"examples of shape {data}; build the model on a single keras.Input(input_shape)"
            )
        if not _compatible(declared[0], data):
            raise ModelError(
                f"--model={name} takes inputs of shape {declared[0]} but the data's examples have "
                f"shape {data}; build it on keras.Input(input_shape) with the input_shape it is given"
            )
    try:
        outputs = model.compute_output_spec(keras.KerasTensor(data, dtype="float32"))
    except Exception as error:  # Whatever a layer raises on the data's shape.
        raise ModelError(
            f"--model={name} cannot take the data's examples of shape {data}: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from None
    flat = keras.tree.flatten(outputs)
    wanted = (None, *element_shape, num_outputs)
    for shape in (tuple(getattr(output, "shape", ())) for output in flat):
        if not _compatible(shape, wanted):
            raise ModelError(
                f"--model={name} outputs shape {shape}; the data's labels need {num_outputs} outputs"
                f"{' for each of ' + str(element_shape[0]) + ' elements' if element_shape else ''}: return "
                f"shape {wanted}, e.g. end with a Dense({num_outputs})"
            )
    return len(flat)


def _declared_input_shapes(model: keras.Model) -> list[tuple[Any, ...]] | None:
    """The shapes of a functional model's `keras.Input`s; None for a subclassed model."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [tuple(tensor.shape) for tensor in keras.tree.flatten(inputs)]


def _compatible(declared: tuple[Any, ...], data: tuple[Any, ...]) -> bool:
    return len(declared) == len(data) and all(
        d is None or g is None or d == g for d, g in zip(declared, data, strict=True)
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""
