"""`--mode=predict`: the latest checkpoint's outputs for the examples of a file.

Reads `--predict_input` (an .npz with an `x` array, or a .csv of numbers
with a header row), prepares it as training prepared its data (uint8
pixels scaled by 1/255, each example reshaped to the model's input), runs
the model restored read-only from `--model_dir` (its moving averages with
--ema_decay) over the replicas, and writes one output row per example, in
the input's order, to a new `--predict_output` (.npy or .csv). The model_dir
is only read.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
from typing import Any

import numpy as np
from absl import logging

from engine import checkpoint as checkpoint_lib
from engine.cli.assembly import CheckpointedModel
from engine.cli.settings import RunConfig
from engine.errors import UserError
from engine.model_dir import latest_checkpoint
from engine.runners import PredictRunner, as_prediction_batches


def run(config: RunConfig) -> dict[str, Any]:
    """Predicts as the flags say; returns the step, the number of rows and where they went."""
    assert config.model_dir and config.predict_input and config.predict_output, "RunConfig.validate"
    directory = checkpoint_lib.checkpoint_dir(config.model_dir)
    path = latest_checkpoint(directory)
    if path is None:
        raise UserError(
            f"--mode=predict: no checkpoint in {directory}; train first or pass the --model_dir of a trained run"
        )
    restored = CheckpointedModel(config, model_dir=config.model_dir)
    inputs = read_examples(config.predict_input, restored.task.input_shape, label_column=config.label_column)
    restored.reader.read(path, strict=True)
    with restored.averaged_weights():
        outputs = PredictRunner(restored.strategy, restored.model).run(
            as_prediction_batches(inputs, config.global_batch_size)
        )
    write_rows(config.predict_output, np.asarray(outputs))
    logging.info(
        "predicted %d examples with %s (step %d); wrote %s",
        len(inputs),
        path,
        restored.step,
        config.predict_output,
    )
    return {"global_step": restored.step, "predictions": len(inputs), "predict_output": config.predict_output}


def read_examples(path: str, input_shape: tuple[int, ...], *, label_column: str | None = None) -> np.ndarray:
    """The examples of `path` as float32 of shape (N, *input_shape), prepared as in training;
    a .csv's `label_column` (the training's --label_column), if it has one, is dropped."""
    if path.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as arrays:
                if "x" not in arrays:
                    raise UserError(f"--predict_input={path} holds {sorted(arrays)}, no `x` array of examples")
                examples = arrays["x"]
        except (OSError, ValueError) as error:
            raise UserError(f"--predict_input={path} is not a readable .npz ({error})") from None
    else:
        examples = _read_csv(path, label_column)
    if examples.dtype == np.uint8:
        examples = examples.astype(np.float32) / 255.0  # As the data sets scale their pixels.
    elif not np.issubdtype(examples.dtype, np.floating) and not np.issubdtype(examples.dtype, np.integer):
        raise UserError(f"--predict_input={path}: examples must be numbers, got {examples.dtype}")
    examples = examples.astype(np.float32)
    if len(examples) == 0:
        raise UserError(f"--predict_input={path} holds no examples")
    size = math.prod(input_shape)
    if tuple(examples.shape[1:]) != input_shape:
        if math.prod(examples.shape[1:]) != size:
            raise UserError(
                f"--predict_input={path}: examples of shape {tuple(examples.shape[1:])} do not fit the model's "
                f"input {input_shape} ({size} values each)"
            )
        examples = examples.reshape((len(examples), *input_shape))
    if not np.isfinite(examples).all():
        raise UserError(f"--predict_input={path} holds NaN or Inf values")
    return examples


def _read_csv(path: str, label_column: str | None) -> np.ndarray:
    from engine.cli.own_packages import own_package

    input_lib = own_package("input")
    with open(path, newline="") as handle:
        header = [name.strip() for name in next(csv.reader(handle), [])]
    try:
        _, features, _ = input_lib.files.read_table(
            path, label_column if label_column in header else None, flag="predict_input"
        )
    except input_lib.DataError as error:
        raise UserError(str(error)) from None
    return features


def write_rows(path: str, outputs: np.ndarray) -> None:
    """One row per example, written to a temporary file and renamed, so a reader never
    sees half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".predict-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(handle, "w" if path.endswith(".csv") else "wb") as out:
            if path.endswith(".npy"):
                np.save(out, outputs)
            else:
                rows = outputs.reshape((len(outputs), -1))
                writer = csv.writer(out)
                writer.writerow([f"output_{index}" for index in range(len(rows[0]))])
                writer.writerows(rows.tolist())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
