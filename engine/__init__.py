"""A distributed training engine for TensorFlow 2 custom loops.

The public API for research code: build a strategy, create your model and
optimizer in its scope, hand them to a `Trainer`. The submodules a user
reaches for (`engine.callbacks`, `engine.hooks`, `engine.schedules`,
`engine.export`, `engine.variables`) are importable as attributes.
"""

from engine import callbacks, export, hooks, schedules, variables
from engine.callbacks import Callback
from engine.errors import DataExhaustedError, NonFiniteLossError, UserError
from engine.strategy import build_strategy, configure_cpu_devices
from engine.steps import call_model, make_eval_step, make_train_step
from engine.trainer import Trainer

__all__ = [
    "Callback",
    "DataExhaustedError",
    "NonFiniteLossError",
    "Trainer",
    "UserError",
    "build_strategy",
    "call_model",
    "callbacks",
    "configure_cpu_devices",
    "export",
    "hooks",
    "make_eval_step",
    "make_train_step",
    "schedules",
    "variables",
]
