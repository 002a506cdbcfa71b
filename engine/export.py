"""`--export_dir`: the trained model as a SavedModel with a serving signature.

A Keras model is exported by Keras itself (`Model.export`, which writes a
`serve` endpoint and the `serving_default` signature); a plain `tf.Module`
gets the same through `tf.saved_model.save`. Either reloads with
`tf.saved_model.load(export_dir)` without the engine or the model's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from engine.steps import call_model

SERVING_SIGNATURE = "serving_default"


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
    logging.info("Exported SavedModel to %s (signature %r)", export_dir, SERVING_SIGNATURE)
    return export_dir
