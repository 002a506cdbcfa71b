"""A distributed training engine for TensorFlow 2 custom loops.

The public API for research code: build a strategy, create your model and
optimizer in its scope, hand them to a `Trainer`.
"""

from engine.errors import UserError
from engine.strategy import build_strategy, configure_cpu_devices
from engine.steps import call_model, make_eval_step, make_train_step
from engine.trainer import Trainer

__all__ = [
    "Trainer",
    "UserError",
    "build_strategy",
    "call_model",
    "configure_cpu_devices",
    "make_eval_step",
    "make_train_step",
]
