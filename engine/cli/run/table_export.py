"""`--export_dir` of a model trained on a table read by its columns' types (`input.tables`): a
SavedModel whose `serving_default` takes the raw columns by name (`input_names`: ASCII letters,
digits, `_` and `.`; numbers as float32, NaN a
blank; everything else as text, "" a blank; one value a row) and returns `logits` and
`probabilities` (and `classes`, the predicted class's name, for a text label) or
`predictions`; and beside it `<export_dir>.keras`, the same model for
`keras.models.load_model` (after `import input.table_layers, models`, which register the
engine's layers), returning probabilities (or values) for a dict of (N, 1) columns. Both
hold the encoding: a client sends the table's rows as they are."""

from __future__ import annotations

import os
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from engine.cli.process.own_packages import own_package
from engine.export import SERVING_SIGNATURE


def keras_file_beside(export_dir: str) -> str:
    """Where the `.keras` file of an export goes: `<export_dir>.keras`."""
    return export_dir.rstrip("/" + os.sep) + ".keras"


def export_table(model: keras.Model, export_dir: str, schema: Any, label_kind: str) -> None:
    """Writes the SavedModel of `model` behind the schema's encoding, and the `.keras` file."""
    layers = own_package("input").table_layers
    full = layers.table_model(schema, model)
    names = layers.input_names(schema)  # A signature's arguments: ASCII letters, digits, `_`, `.`.
    dtypes = {names[column.name]: layers.input_dtype(column.type) for column in schema.used}

    def serve(columns: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        outputs = tf.cast(full({name: tf.expand_dims(value, -1) for name, value in columns.items()}), tf.float32)
        if label_kind == "values":
            return {"predictions": outputs}
        probabilities = tf.nn.softmax(outputs) if label_kind == "classes" else tf.sigmoid(outputs)
        served = {"logits": outputs, "probabilities": probabilities}
        if schema.classes:
            served["classes"] = tf.gather(tf.constant(list(schema.classes)), tf.argmax(probabilities, axis=-1))
        return served

    archive = keras.export.ExportArchive()
    archive.track(full)
    spec = {name: tf.TensorSpec([None], tf.dtypes.as_dtype(dtype), name=name) for name, dtype in dtypes.items()}
    archive.add_endpoint(name="serve", fn=serve, input_signature=[spec])
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)  # Not "input name(s) table_handle ... will be renamed" (a lookup's).
    try:
        archive.write_out(export_dir, verbose=False)
    finally:
        logging.set_verbosity(verbosity)
    logging.info(
        "Exported SavedModel to %s (signature %r: the raw columns %s)",
        export_dir,
        SERVING_SIGNATURE,
        ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items()),
    )
    head = None
    if label_kind == "classes":
        head = keras.layers.Softmax(name="probabilities", dtype="float32")
    elif label_kind == "multi_label":
        head = keras.layers.Activation("sigmoid", name="probabilities", dtype="float32")
    path = keras_file_beside(export_dir)
    layers.table_model(schema, model, head).save(path)
    logging.info("Wrote %s (keras.models.load_model; import input.table_layers, models first)", path)
