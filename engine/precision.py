"""Loss scaling under float16, as Keras `compile()` gives it.

float16 gradients of a small loss underflow to zero: `compile()` under a
`mixed_float16` dtype policy wraps a plain optimizer in a
`keras.optimizers.LossScaleOptimizer` (a dynamic loss scale), and the engine
does the same, in one place for the Trainer and the command line. The loss
scale is optimizer state (checkpointed, restored on resume), so the wrapping
happens before the optimizer is built and before any checkpoint is read.
"""

from __future__ import annotations

from typing import Any

import keras

from engine.logger import logger

FLOAT16_POLICY = "mixed_float16"


def dtype_policy_of(model: Any = None) -> str:
    """The dtype policy `compile()` would look at: the Keras model's own, else (a `tf.Module`, or
    no model) the global one."""
    policy = getattr(model, "dtype_policy", None) if isinstance(model, keras.layers.Layer) else None
    if policy is None:
        policy = keras.mixed_precision.global_policy()
    return str(getattr(policy, "name", policy))


def needs_loss_scaling(optimizer: keras.optimizers.Optimizer, model: Any = None) -> bool:
    """Whether `compile()` would wrap `optimizer`: a mixed_float16 policy and no loss scale yet."""
    return dtype_policy_of(model) == FLOAT16_POLICY and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    )


def with_loss_scaling(optimizer: keras.optimizers.Optimizer, model: Any = None) -> keras.optimizers.Optimizer:
    """`optimizer` wrapped in a dynamic `LossScaleOptimizer` where `compile()` would wrap it (see
    `needs_loss_scaling`), else `optimizer` itself. Call it in the strategy's scope (the scale is a
    variable), before the optimizer is built and before a checkpoint is restored into it."""
    if not needs_loss_scaling(optimizer, model):
        return optimizer
    logger.info(
        "mixed_float16: %s trains under a dynamic loss scale (keras.optimizers.LossScaleOptimizer), "
        "as Keras compile() wraps it",
        type(optimizer).__name__,
    )
    return keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
