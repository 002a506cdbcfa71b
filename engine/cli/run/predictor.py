"""`--mode=predict`: the latest checkpoint's outputs for the examples of a file.

Reads `--predict_input` (an .npz with an `x` array, or a .csv of numbers
with a header row), prepares it as training prepared its data (uint8
pixels scaled by 1/255, each example reshaped to the model's input), runs
the model restored read-only from `--model_dir` (its moving averages with
--ema_decay) over the replicas, and writes one output row per example, in
the input's order, to a new `--predict_output` (.npy or .csv). The model_dir
is only read.

The model is rebuilt from `<model_dir>/inputs.json` (engine.cli.run.inputs_record), not from
the training's data, which need not exist any more; a CSV's columns are read by the
names the model was trained on, in that order (its label column and any other column
are not read), so a file with its columns in another order predicts the same. A
model_dir without inputs.json (an older run) reads the training's data as before, and a
CSV's columns by position. The output is written to a temporary file beside it and
linked into place only if nothing is there: two predicts to one path never replace each
other's file.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import math
import os
import tempfile
import zipfile
import zlib
from typing import Any

import numpy as np
from absl import logging

from engine.checkpointing import checkpointer as checkpoint_lib
from engine.checkpointing.discovery import latest_checkpoint
from engine.cli.config.settings import RunConfig
from engine.cli.run import inputs_record
from engine.cli.run.assembly import CheckpointedModel
from engine.errors import UserError
from engine.loop.runners import PredictRunner, as_prediction_batches


def run(config: RunConfig) -> dict[str, Any]:
    """Predicts as the flags say; returns the step, the number of rows and where they went."""
    assert config.model_dir and config.predict_input and config.predict_output, "RunConfig.validate"
    directory = checkpoint_lib.checkpoint_dir(config.model_dir)
    path = latest_checkpoint(directory)
    if path is None:
        raise UserError(
            f"--mode=predict: no checkpoint in {directory}; train first or pass the --model_dir of a trained run"
        )
    record = inputs_record.read(config.model_dir)
    if record is not None and record.table is not None:  # A table read by its columns' types.
        from engine.cli.run.table_predict import predict_table

        return predict_table(config, record, path, write_rows)
    columns = record.feature_columns if record is not None else None
    if record is not None:  # The examples' shape without the training's data: nothing else is read.
        restored = CheckpointedModel(config, model_dir=config.model_dir, source=record.source(config.dataset))
    else:
        restored = CheckpointedModel(config, model_dir=config.model_dir)
    inputs = read_examples(
        config.predict_input, restored.task.input_shape, label_column=config.label_column, columns=columns
    )
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


def read_examples(
    path: str,
    input_shape: tuple[int, ...],
    *,
    label_column: str | None = None,
    columns: tuple[str, ...] | None = None,
) -> np.ndarray:
    """The examples of `path` as float32 of shape (N, *input_shape), prepared as in training.
    A .csv's `columns` (the training's feature columns) are read by name; without them, every
    column by position but `label_column` (the training's --label_column), if it has one."""
    if path.endswith(".npz"):
        from engine.cli.process.own_packages import own_package

        input_files = own_package("input").files
        try:
            input_files.check_npz_sizes(path, ("x",), where=f"--predict_input={path}")
        except own_package("input").DataError as error:
            raise UserError(str(error)) from None
        try:
            loaded = np.load(path, allow_pickle=False)
            if not hasattr(loaded, "files"):  # np.save's single array, whatever the file's name.
                raise UserError(f"--predict_input={path} is one .npy array; save it as np.savez(path, x=...)")
            with loaded as arrays:
                if "x" not in arrays:
                    raise UserError(f"--predict_input={path} holds {sorted(arrays)}, no `x` array of examples")
                examples = arrays["x"]
        except MemoryError:  # Measured above; what else is in memory may still leave too little.
            raise UserError(f"--predict_input={path} does not fit in the memory left to this process") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            raise UserError(f"--predict_input={path} is not a readable .npz ({error})") from None
    else:
        examples = _read_csv(path, label_column, columns)
    if examples.ndim == 0:
        raise UserError(
            f"--predict_input={path}: x is a single value (a 0-d array), not examples; save one example a row, "
            "x of shape (N, ...)"
        )
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


def _read_csv(path: str, label_column: str | None, columns: tuple[str, ...] | None) -> np.ndarray:
    from engine.cli.process.own_packages import own_package

    files = own_package("input").files
    try:
        if columns is not None:
            features, others = files.read_columns(path, list(columns), flag="predict_input")
            ignored = [name for name in others if name != label_column]
            if ignored:
                logging.info("--predict_input=%s: columns not read (not features): %s", path, ",".join(ignored))
            return features
        header = files.csv_header(path, flag="predict_input")
        _, features, _ = files.read_table(
            path, label_column if label_column in header else None, flag="predict_input"
        )
    except own_package("input").DataError as error:
        raise UserError(str(error)) from None
    return features


# What a file system without hard links says to os.link (then an O_EXCL claim of the name is used).
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def write_rows(
    path: str, outputs: np.ndarray, header: list[str] | None = None, rows: list | None = None
) -> None:
    """One row per example, written to a temporary file beside `path` and moved there only if
    nothing is there yet (a hard link fails on an existing name; another predict's file, or
    anyone's, is never replaced), so a reader never sees half of it. A full disk or another
    write error is one line, and nothing is left behind. A .csv's columns are `output_0..`,
    or `header` over `rows` (a table's class names and probabilities) where given."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".predict-", suffix=os.path.splitext(path)[1])
    except OSError as error:
        raise UserError(_write_problem(path, error)) from None
    try:
        with os.fdopen(handle, "w" if path.endswith(".csv") else "wb") as out:
            if path.endswith(".npy"):
                np.save(out, outputs)
            else:
                values = outputs.reshape((len(outputs), -1))
                writer = csv.writer(out)
                writer.writerow(header or [f"output_{index}" for index in range(len(values[0]))])
                writer.writerows(rows if rows is not None else values.tolist())
            out.flush()
            os.fsync(out.fileno())
        _move_into_place(temporary, path)
    except FileExistsError:
        raise UserError(
            f"--predict_output={path} appeared while this command predicted (another command wrote it); it was "
            "left as it is: pass a new path"
        ) from None
    except OSError as error:
        raise UserError(_write_problem(path, error)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def _move_into_place(temporary: str, path: str) -> None:
    """`temporary` at `path` if `path` does not exist, else FileExistsError (never replaced)."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise
    except OSError as error:
        if error.errno not in _NO_HARD_LINKS:
            raise
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))  # Claims the name, or fails.
        os.replace(temporary, path)  # Over our own empty claim only.


def _write_problem(path: str, error: OSError) -> str:
    reason = error.strerror or str(error)
    hint = (
        "free some space, or pass a --predict_output on another disk"
        if error.errno
        in (
            errno.ENOSPC,
            errno.EDQUOT,
        )
        else "pass a --predict_output where this user can write"
    )
    return f"--predict_output={path} cannot be written ({reason}); {hint}; nothing was written there"
