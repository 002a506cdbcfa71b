"""The run's settings for TensorBoard's HParams tab (`tensorboard.plugins.hparams`).

Written once at `<model_dir>` itself, so a TensorBoard over a folder of
model_dirs lists each as one session, with its `train` and `eval` runs'
scalars as the metrics to compare.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp


def write_hparams(model_dir: str, settings: Mapping[str, Any]) -> None:
    """Writes `settings` (unset ones are left out: HParams has no None)."""
    values = {name: value for name, value in settings.items() if isinstance(value, (bool, int, float, str))}
    writer = tf.summary.create_file_writer(model_dir)
    with writer.as_default():
        hp.hparams(values, trial_id=model_dir)
    writer.close()
