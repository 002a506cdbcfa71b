"""`--mode=predict` of a model trained on a table read by its columns' types (`input.tables`):
the rows of a raw `--predict_input` (.csv or .parquet, its columns in any order, the label's
there or not) encoded by the layers the training's schema (inputs.json) rebuilds, and
written in the table's own terms: the predicted class's name under the label's name and one
probability column per class, named by the class; or the predicted value under the label's
name. An .npy output holds the probabilities (or values) alone."""

from __future__ import annotations

from typing import Any

import numpy as np
from absl import logging

from engine.cli.config.settings import RunConfig
from engine.cli.process.own_packages import own_package
from engine.cli.run.assembly import CheckpointedModel
from engine.errors import UserError
from engine.loop.runners import PredictRunner, as_prediction_batches


def predict_table(config: RunConfig, record: Any, checkpoint: str, write_rows: Any) -> dict[str, Any]:
    """Predicts the rows of --predict_input with the `checkpoint` of a table's model; writes them
    with `write_rows` (predictor's: a new file, never over another)."""
    schema = record.table
    restored = CheckpointedModel(config, model_dir=config.model_dir, source=record.source(config.dataset))
    encoded = encoded_rows(config.predict_input, schema)
    restored.reader.read(checkpoint, strict=True)
    with restored.averaged_weights():
        outputs = PredictRunner(restored.strategy, restored.model).run(
            as_prediction_batches(encoded, config.global_batch_size)
        )
    values, header, rows = named_outputs(np.asarray(outputs), record.label_kind, schema)
    write_rows(config.predict_output, values, header, rows)
    logging.info(
        "predicted %d rows with %s (step %d); wrote %s",
        len(rows),
        checkpoint,
        restored.step,
        config.predict_output,
    )
    return {"global_step": restored.step, "predictions": len(rows), "predict_output": config.predict_output}


def encoded_rows(path: str, schema: Any) -> np.ndarray:
    """The rows of `path` encoded as training encoded its split; every column it lacks, and every
    cell a number or date column cannot read, in one line."""
    input_lib = own_package("input")
    if not input_lib.tables.is_table_file(path):
        raise UserError(
            f"--predict_input={path}: this model was trained on a table ({schema.label!r} its label); "
            "give it rows as a .csv or .parquet file with the columns it was trained on"
        )
    try:
        frame = input_lib.tables.read_frame(path, "predict_input")
    except input_lib.DataError as error:
        raise UserError(str(error)) from None
    missing = [column.name for column in schema.used if column.name not in frame.columns]
    problems = [f"it has no column {', '.join(repr(name) for name in missing)}"] if missing else []
    problems += input_lib.tables.check_cells(frame, schema, "its rows")
    if problems:
        raise UserError(f"--predict_input={path} cannot be predicted: " + "; ".join(problems))
    others = [name for name in frame.columns if name not in {c.name for c in schema.used} | {schema.label}]
    if others:
        logging.info("--predict_input=%s: columns not read (not features): %s", path, ",".join(others))
    return input_lib.table_layers.encode_arrays(schema, input_lib.tables.raw_columns(frame, schema))


def named_outputs(outputs: np.ndarray, label_kind: str, schema: Any) -> tuple[np.ndarray, list[str], list[list]]:
    """(the numbers an .npy holds, a .csv's header, its rows): for classes the predicted class's
    name and each class's probability, for one 0/1 label its 0 and 1 probabilities, for
    values the predicted value(s)."""
    label = schema.label
    logits = outputs.astype(np.float64).reshape(len(outputs), -1)
    if label_kind == "values":
        header = [label] if logits.shape[1] == 1 else [f"{label}_{index}" for index in range(logits.shape[1])]
        return logits.astype(np.float32), header, logits.tolist()
    if label_kind == "classes":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = shifted / shifted.sum(axis=1, keepdims=True)
        names = list(schema.classes) if schema.classes else [str(index) for index in range(logits.shape[1])]
    else:  # One 0/1 label: a sigmoid's probability of 1.
        one = 1.0 / (1.0 + np.exp(-logits[:, :1]))
        probabilities = np.concatenate([1.0 - one, one], axis=1)
        names = ["0", "1"]
    header = [label, *(name if name != label else f"{name} (class)" for name in names)]
    chosen = probabilities.argmax(axis=1)
    rows = [[names[index], *row] for index, row in zip(chosen.tolist(), probabilities.tolist(), strict=True)]
    return probabilities.astype(np.float32), header, rows
