"""Every kind of hook the trainer takes, turned into `Callback`s it calls the same way."""

from __future__ import annotations

from collections.abc import Sequence

from engine.callbacks.base import Callback, CallbackLike, LoopFunction


def as_callbacks(hooks: Sequence[CallbackLike], *, steps_per_epoch: int | None = None) -> list[Callback]:
    """Wraps plain callables and Keras callbacks so the trainer calls every hook the same way.

    The Keras callbacks share one adapter, at the place of the first of them,
    so that they see one set of epoch logs in their order, as under `fit`.
    """
    from engine.callbacks.keras_adapter import KerasCallbacks, is_keras_callback  # Imports Keras.

    keras_hooks = [hook for hook in hooks if is_keras_callback(hook)]
    callbacks: list[Callback] = []
    for hook in hooks:
        if is_keras_callback(hook):
            if hook is keras_hooks[0]:
                callbacks.append(KerasCallbacks(keras_hooks, steps_per_epoch=steps_per_epoch))
        elif isinstance(hook, Callback):
            callbacks.append(hook)
        elif callable(hook):
            callbacks.append(LoopFunction(hook))
        else:
            raise TypeError(f"callback {hook!r} is neither a Callback, a keras.callbacks.Callback nor callable")
    return callbacks
