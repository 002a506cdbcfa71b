"""A distributed training engine for TensorFlow 2 custom loops.

The public API for research code: build a strategy, create your model and
optimizer in its scope, hand them to a `Trainer`.
"""

import signal as _signal

# Threads that TensorFlow starts while it is imported inherit this mask and so
# never take SIGTERM/SIGINT: the signals then reach the main thread, or stay
# pending during a cluster task's start-up where engine.multi_host sees them.
_mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGTERM, _signal.SIGINT})
try:
    import tensorflow  # noqa: F401,E402
finally:
    _signal.pthread_sigmask(_signal.SIG_SETMASK, _mask)

from engine.errors import UserError  # noqa: E402
from engine.strategy import build_strategy, configure_cpu_devices  # noqa: E402
from engine.steps import call_model, make_eval_step, make_train_step  # noqa: E402
from engine.trainer import Trainer  # noqa: E402

__all__ = [
    "Trainer",
    "UserError",
    "build_strategy",
    "call_model",
    "configure_cpu_devices",
    "make_eval_step",
    "make_train_step",
]
