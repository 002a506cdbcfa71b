"""Process-wide settings a run needs before its model exists: seeds,
op determinism and the mixed-precision policy."""

from __future__ import annotations

import keras
import tensorflow as tf

from engine.errors import UserError
from engine.options import PRECISION_POLICIES


def seed_everything(seed: int, *, deterministic: bool = False) -> None:
    """Seeds Python, NumPy and TF; with `deterministic`, ops are too.

    Op determinism makes reruns and resumed runs bitwise equal at some cost
    in speed, so it is opt-in.
    """
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()


def set_precision(mixed_precision: str) -> None:
    """Sets the Keras global dtype policy; must run before models are built."""
    if mixed_precision not in PRECISION_POLICIES:
        raise UserError(
            f"unknown --mixed_precision={mixed_precision!r}; choose one of: {', '.join(PRECISION_POLICIES)}"
        )
    keras.mixed_precision.set_global_policy(PRECISION_POLICIES[mixed_precision])
