"""Hooks around the compiled loop, one package for every kind.

- `base`: `Callback` (the hooks the trainer calls, all declared there) and
  `TrainerView` (what a hook sees of the trainer);
- `compose`: `as_callbacks`, which turns plain callables and Keras callbacks
  into `Callback`s;
- `keras_adapter`: drives `keras.callbacks.Callback`s at epoch ends as `fit` does;
- `progress`: the progress lines and bar.

The built-in hooks (early stopping, best checkpoint, ...) are `engine.hooks`.
"""

from engine.callbacks.base import Callback, CallbackLike, Logs, LoopFn, TrainerView
from engine.callbacks.compose import as_callbacks

__all__ = ["Callback", "CallbackLike", "Logs", "LoopFn", "TrainerView", "as_callbacks"]
