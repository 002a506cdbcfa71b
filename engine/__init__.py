"""A distributed training engine for TensorFlow 2 custom loops.

The public API for research code: build a strategy, create your model and
optimizer in its scope, hand them to a `Trainer`, with its options in groups
(`engine.StepOptions`, `Cadence`, `CheckpointOptions`, `SpikeOptions`,
`ThroughputOptions`: `engine.options`). The submodules a user
reaches for (`engine.callbacks`, `engine.hooks`, `engine.schedules`,
`engine.export`, `engine.variables`) are importable as attributes.

Research code that imports `engine` before TensorFlow gets TensorFlow
imported here with its C++ start-up lines held back, as the command line
does (`engine.native_logs`; `TF_CPP_MIN_LOG_LEVEL=0` shows them). The
command line itself (`python -m engine.<module>`) imports TensorFlow later,
so that it can block SIGTERM/SIGINT for its signal watcher before
TensorFlow starts its threads (see `engine.cli.process.preemption`); the rest of the
API is imported on first use (PEP 562).
"""

import importlib
import os
import sys

from engine.errors import DataExhaustedError, NonFiniteLossError, UserError


def _started_as_engine_command() -> bool:
    """Whether this process is `python -m engine.<module>` (the CLI, the launcher, a server), or
    `python -m benchmarks.<module>`, which measures the engine as its commands run it
    (benchmarks/__init__.py)."""
    argv = list(getattr(sys, "orig_argv", []))
    for index, arg in enumerate(argv):
        module = (
            argv[index + 1]
            if arg == "-m" and index + 1 < len(argv)
            else arg[2:]
            if arg.startswith("-m")
            else None
        )
        if module is not None:
            return module.startswith(("engine.", "benchmarks."))
    return False


if _started_as_engine_command():
    from engine.command_start import tune_for_start_up

    tune_for_start_up()  # Before numpy's import: its BLAS threads, the collector's threshold.
elif "tensorflow" not in sys.modules:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # The runtime's later C++ lines, as engine.main sets it.
    from engine.native_logs import import_tensorflow_quietly

    import_tensorflow_quietly()

_SUBMODULES = ("callbacks", "data", "export", "hooks", "layers", "objectives", "schedules", "variables")
_LAZY = {
    "Cadence": "engine.options",
    "Callback": "engine.callbacks",
    "CheckpointOptions": "engine.options",
    "DataService": "engine.options",
    "GlobalBatches": "engine.data",
    "PerReplicaBatches": "engine.data",
    "ResidentData": "engine.resident",
    "ResidentEvalData": "engine.resident",
    "ShardedEmbedding": "engine.layers",
    "SpikeOptions": "engine.options",
    "StepOptions": "engine.options",
    "Task": "engine.task",
    "ThroughputOptions": "engine.options",
    "Trainer": "engine.trainer",
    "TrainerView": "engine.callbacks",
    "build_strategy": "engine.strategy",
    "configure_cpu_devices": "engine.strategy",
    "call_model": "engine.loop.steps",
    "make_eval_step": "engine.loop.steps",
    "make_train_step": "engine.loop.steps",
}

__all__ = [
    "Cadence",
    "Callback",
    "CheckpointOptions",
    "DataExhaustedError",
    "DataService",
    "GlobalBatches",
    "NonFiniteLossError",
    "PerReplicaBatches",
    "ResidentData",
    "ResidentEvalData",
    "ShardedEmbedding",
    "SpikeOptions",
    "StepOptions",
    "Task",
    "ThroughputOptions",
    "Trainer",
    "TrainerView",
    "UserError",
    "build_strategy",
    "call_model",
    "callbacks",
    "configure_cpu_devices",
    "data",
    "export",
    "hooks",
    "layers",
    "make_eval_step",
    "make_train_step",
    "objectives",
    "schedules",
    "variables",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"engine.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
