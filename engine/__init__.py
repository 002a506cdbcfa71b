"""A distributed training engine for TensorFlow 2 custom loops.

The public API for research code: build a strategy, create your model and
optimizer in its scope, hand them to a `Trainer`. The submodules a user
reaches for (`engine.callbacks`, `engine.hooks`, `engine.schedules`,
`engine.export`, `engine.variables`) are importable as attributes.

Everything but the errors is imported on first use (PEP 562), so that
`python -m engine.main` can block SIGTERM/SIGINT for its signal watcher
before TensorFlow starts its threads (see `engine.preemption`).
"""

import importlib

from engine.errors import DataExhaustedError, NonFiniteLossError, UserError

_SUBMODULES = ("callbacks", "export", "hooks", "schedules", "variables")
_LAZY = {
    "Callback": "engine.callbacks",
    "ResidentData": "engine.resident",
    "Trainer": "engine.trainer",
    "TrainerView": "engine.callbacks",
    "build_strategy": "engine.strategy",
    "configure_cpu_devices": "engine.strategy",
    "call_model": "engine.steps",
    "make_eval_step": "engine.steps",
    "make_train_step": "engine.steps",
}

__all__ = [
    "Callback",
    "DataExhaustedError",
    "NonFiniteLossError",
    "ResidentData",
    "Trainer",
    "TrainerView",
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


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"engine.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
