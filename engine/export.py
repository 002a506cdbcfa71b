"""`--export_dir`: the trained model as a SavedModel with a serving signature.

A Keras model is exported by Keras itself (`Model.export`, which writes a
`serve` endpoint and the `serving_default` signature); a plain `tf.Module`
gets the same through `tf.saved_model.save`. Either reloads with
`tf.saved_model.load(export_dir)` without the engine or the model's code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from engine.errors import UserError
from engine.logger import logger
from engine.loop.steps import call_model

SERVING_SIGNATURE = "serving_default"
INPUT_NAME = "features"
# The outputs by label kind (engine.objectives): the model's own, then what they mean.
OUTPUT_NAMES = {
    "classes": ("logits", "probabilities"),
    "multi_label": ("logits", "probabilities"),
    "values": ("predictions",),
}


# What an export holds (`Model.export`, `tf.saved_model.save`): a directory holding these alone is
# an earlier export, which the next one replaces (a rerun of a finished run exports again).
SAVED_MODEL_ENTRIES = frozenset({"saved_model.pb", "saved_model.pbtxt", "fingerprint.pb", "variables", "assets"})
# What the engine keeps at the top of a model_dir (engine.model_dir): an export there would mix in.
_MODEL_DIR_ENTRIES = ("checkpoints", "best", "hooks", "train", "eval", "diagnostics")


def check_export_dir(export_dir: str, model_dir: str | None) -> None:
    """Refuses, before anything is written, an `export_dir` that is the model_dir itself or one of
    the directories the engine keeps in it, is not a directory, or holds anything but an
    earlier export: the SavedModel's files would be written in among someone's files (and the
    directory would no longer load as one export). A directory of its own inside the model_dir
    (`<model_dir>/export`) is fine."""
    if model_dir and "://" not in export_dir and "://" not in model_dir:
        export, top = os.path.realpath(export_dir), os.path.realpath(model_dir)
        kept = [os.path.join(top, name) for name in _MODEL_DIR_ENTRIES]
        if export == top or any(export == path or export.startswith(path + os.sep) for path in kept):
            raise UserError(
                f"`export_dir={export_dir!r}` is inside the model_dir's own files ({model_dir}); "
                f"pass a directory of its own, e.g. {os.path.join(model_dir, 'export')}"
            )
    if not tf.io.gfile.exists(export_dir):
        return
    if not tf.io.gfile.isdir(export_dir):
        raise UserError(f"`export_dir={export_dir!r}` is a file, not a directory; pass a new directory")
    others = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(export_dir))
    others = [name for name in others if name not in SAVED_MODEL_ENTRIES]
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(
            f"`export_dir={export_dir!r}` holds files that are not an export ({shown}); nothing was "
            "written: pass a new or empty directory, or an earlier export to replace"
        )


def export_saved_model(model: Any, export_dir: str, input_signature: Sequence[tf.TensorSpec]) -> str:
    """Writes `model` (inference mode) to `export_dir`; returns the directory."""
    if isinstance(model, keras.Model):
        model.export(export_dir, format="tf_saved_model", input_signature=list(input_signature), verbose=False)
    else:
        serving = tf.Module()
        serving.model = model  # Tracks the variables.
        serving.serve = tf.function(
            lambda inputs: call_model(model, inputs, training=False), input_signature=list(input_signature)
        )
        tf.saved_model.save(serving, export_dir, signatures={SERVING_SIGNATURE: serving.serve})
    logger.info("Exported SavedModel to %s (signature %r)", export_dir, SERVING_SIGNATURE)
    return export_dir


def export_for_serving(
    model: keras.Model, export_dir: str, *, input_shape: tuple[int, ...], input_dtype: str, label_kind: str
) -> str:
    """The command line's export: a `serving_default` signature that takes the examples as the
    data holds them, under the name `features` (uint8 pixels are scaled by 1/255 inside, as
    training scaled them; floats are taken as they are), and returns named outputs: `logits`
    and `probabilities` (softmax for classes, sigmoid for 0/1 labels), or `predictions` for
    values. A client needs neither the engine nor the model's code, nor to know the scaling."""
    if label_kind not in OUTPUT_NAMES:
        raise ValueError(f"label_kind={label_kind!r} is not one of {tuple(OUTPUT_NAMES)}")

    def serve(features: tf.Tensor) -> dict[str, tf.Tensor]:
        inputs = tf.cast(features, tf.float32)
        if features.dtype == tf.uint8:
            inputs = inputs / 255.0
        outputs = tf.cast(model(inputs, training=False), tf.float32)
        if label_kind == "values":
            return {"predictions": outputs}
        probabilities = tf.nn.softmax(outputs) if label_kind == "classes" else tf.sigmoid(outputs)
        return {"logits": outputs, "probabilities": probabilities}

    archive = keras.export.ExportArchive()
    archive.track(model)
    spec = tf.TensorSpec([None, *input_shape], tf.dtypes.as_dtype(input_dtype), name=INPUT_NAME)
    archive.add_endpoint(name="serve", fn=serve, input_signature=[spec])
    archive.write_out(export_dir, verbose=False)
    logger.info(
        "Exported SavedModel to %s (signature %r: %s %s %s -> %s)",
        export_dir,
        SERVING_SIGNATURE,
        INPUT_NAME,
        input_dtype,
        (None, *input_shape),
        ", ".join(OUTPUT_NAMES[label_kind]),
    )
    return export_dir
