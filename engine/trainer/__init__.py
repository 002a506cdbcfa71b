"""The Trainer, in one home: the outer loop (`trainer`), its arguments checked and the model's
state made ready before anything is traced (`checks`), and its parameter-server form run by the
coordinator (`coordinated`). It sits above `engine.loop` (no module there imports it).

`engine.trainer.Trainer` is `engine.Trainer`.
"""

from engine.errors import DataExhaustedError, NonFiniteLossError
from engine.trainer.trainer import Trainer

__all__ = ["DataExhaustedError", "NonFiniteLossError", "Trainer"]  # The errors live in engine.errors.
