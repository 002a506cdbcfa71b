"""Exponential moving average of the weights (`ema_decay`, `--ema_decay`).

The averages are Keras's own: a Keras 3 optimizer created or switched to
`use_ema=True` keeps one average per trainable variable and updates it in
`apply`, after the update, so training itself is unchanged. They are
optimizer variables, so every checkpoint holds them beside the weights and
a resume restores both. What `fit` does once at its end
(`finalize_variable_values`), the engine does around each evaluation, the
best checkpoint and the export: swap the averages in, then put the training
weights back bit for bit (`WeightAverages.swapped_in`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import keras
import tensorflow as tf

from engine.compat import optimizer_averages, optimizer_variables
from engine.errors import UserError


class WeightAverages:
    """The moving averages one optimizer keeps of the variables it updates."""

    def __init__(self, optimizer: keras.optimizers.Optimizer):
        self.optimizer = optimizer

    @property
    def decay(self) -> float:
        return float(self.optimizer.ema_momentum)

    def _variables(self) -> list:
        # The variables in the order the optimizer was built on: Keras pairs averages by position.
        return optimizer_variables(self.optimizer)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model holds the averages; after it (also on an error) the
        training weights again, restored exactly from a copy taken before."""
        variables = self._variables()
        saved = [tf.identity(tf.convert_to_tensor(variable)) for variable in variables]
        self.optimizer.finalize_variable_values(variables)
        try:
            yield
        finally:
            for variable, value in zip(variables, saved, strict=True):
                variable.assign(value)

    def reset_to_weights(self) -> None:
        """Starts the averages at the current weights (fresh optimizer state on resumed weights:
        Keras starts an average at the weights only at iteration 0)."""
        averages = optimizer_averages(self.optimizer)
        for average, variable in zip(averages, self._variables(), strict=False):
            average.assign(tf.convert_to_tensor(variable))


def averages_swapped_in(averages: WeightAverages | None) -> contextlib.AbstractContextManager[None]:
    """`averages.swapped_in()`, or nothing to do where there are no averages (no EMA)."""
    return contextlib.nullcontext() if averages is None else averages.swapped_in()


def weight_averages(
    optimizers: Mapping[str, keras.optimizers.Optimizer], ema_decay: float | None
) -> WeightAverages | None:
    """Turns on the averages of the one optimizer (before it is built), or finds
    the ones its creator turned on (`use_ema=True`); None when there are none.

    Several optimizers (a `step_fn` applying each to a part of the model) are
    refused with `ema_decay`: which average belongs to which part is the
    step's business. Their own `use_ema` is left as Keras leaves it (the
    averages are checkpointed, not swapped in).
    """
    if ema_decay is not None and not 0.0 < ema_decay < 1.0:
        raise UserError(f"`ema_decay={ema_decay}` must be between 0 and 1 (e.g. 0.999), exclusive")
    if len(optimizers) > 1:
        if ema_decay is not None:
            raise UserError(
                f"`ema_decay={ema_decay}` averages the weights of one optimizer, got "
                f"{len(optimizers)} ({', '.join(optimizers)}); create those optimizers "
                "with `use_ema=True` and swap their averages in yourself"
            )
        return None
    (optimizer,) = optimizers.values()
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # A LossScaleOptimizer applies its inner one.
    if inner.use_ema:
        if ema_decay is not None and ema_decay != inner.ema_momentum:
            raise UserError(
                f"`ema_decay={ema_decay}` differs from the optimizer's "
                f"`ema_momentum={inner.ema_momentum}`; pass one of them"
            )
        return WeightAverages(inner)
    if ema_decay is None:
        return None
    if inner.built:
        raise UserError(
            f"`ema_decay={ema_decay}` needs an optimizer that is not built yet (its averages are "
            f"made when it is built); create it with `use_ema=True, ema_momentum={ema_decay}`, "
            "or leave building it to the Trainer"
        )
    inner.use_ema, inner.ema_momentum, inner.ema_overwrite_frequency = True, ema_decay, None
    return WeightAverages(inner)
