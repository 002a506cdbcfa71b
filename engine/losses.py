"""How per-element losses become a step's loss and an evaluation's: the mean over the real
elements of the global batch (or of the whole eval set).

A `loss_fn(labels, outputs)` returns one value per element of an output, unreduced: `(B,)`
for a label per example, `(B, T)` for a label per token, `(B, T, ...)` alike. Every rank is
reduced the same way, as Keras's default `"sum_over_batch_size"` reduction does it:

    loss = sum(w * l over the real elements) / (the number of real elements)

The real elements are those Keras's output mask keeps (`Embedding(mask_zero=True)` and the
layers after it mark the padding); `w` is the sample weight (an element of weight 0 still
counts, as in Keras). What differs from `fit`, and is the point: both sums run over the
GLOBAL batch, every replica and every accumulation micro-batch together, so one replica,
N replicas and accumulation all train on the same mean. Keras `fit` divides each replica's
batch by its own count and averages the replicas.

Several outputs (a list or dict of tensors) take `loss_fn` nested the same way, one loss an
output, and optionally `loss_weights` nested alike: each output's loss is its own mean over
its own real elements, and the loss is their weighted sum (Keras `compile(loss=...,
loss_weights=...)`). One callable for nested outputs receives the whole structure and
reduces as one output; it then applies masks itself. A loss_fn that reduces over time itself
(one value per example from `(B, T)` outputs) is normalized per example: that is how to ask
for per-example normalization.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from engine.compat import keras_mask, user_code
from engine.errors import UserError

PerElementLoss = Callable[[Any, Any], tf.Tensor]
# A loss_fn: one callable, or callables nested like the model's outputs (a dict or list).
LossFn = PerElementLoss | Mapping[str, PerElementLoss] | Sequence[PerElementLoss] | Any


@dataclass(frozen=True)
class SameLabels:
    """`loss` applied to each of a model's `outputs` outputs, every one against the same labels
    (an auxiliary head, deep supervision): the terms are weighted 1.0 each, as Keras weighs one
    loss given for several outputs. The command line trains a --model of several outputs so."""

    loss: PerElementLoss
    outputs: int


@dataclass(frozen=True)
class LossTerm:
    """One output's losses in one (micro-)batch on one replica."""

    total: tf.Tensor  # sum(w * l) over the real elements (float32, differentiable)
    count: tf.Tensor  # how many real elements (float32, no gradient)
    # Elements per example where the count follows from the example count alone (no mask, a
    # static shape): the step then needs no all-reduce to know it. None: counted.
    per_example: int | None


class Objective:
    """`loss_fn` and `loss_weights` as the step and the evaluation apply them.

    Args:
      loss_fn: a callable `(labels, outputs) -> per-element losses`, or callables nested
        like the outputs (dict keys or list positions of the outputs).
      loss_weights: None (each 1.0), or floats nested like a nested `loss_fn`.
    """

    def __init__(self, loss_fn: LossFn | SameLabels, loss_weights: Any = None):
        self.same_labels = isinstance(loss_fn, SameLabels)
        if isinstance(loss_fn, SameLabels):
            loss_fn = [loss_fn.loss] * loss_fn.outputs
        self.loss_fn = loss_fn
        self.nested = not callable(loss_fn)
        self._losses: list[PerElementLoss] = tf.nest.flatten(loss_fn) if self.nested else [loss_fn]  # type: ignore[list-item]
        for loss in self._losses:
            check_per_element(loss)
        self.weights = self._weights(loss_weights)

    @property
    def num_terms(self) -> int:
        return len(self._losses)

    def term_names(self, model: Any = None) -> list[str]:
        """Each output's name, in the terms' order, as Keras `evaluate` names each output's loss
        (`<name>_loss`): a dict's keys, a list's Keras output names (`output_<i>` where unknown);
        [] for one loss."""
        if not self.nested:
            return []
        if isinstance(self.loss_fn, Mapping):
            return [str(key) for key in sorted(self.loss_fn)]
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != self.num_terms:
            names = [f"output_{index}" for index in range(self.num_terms)]
        return names

    def _weights(self, loss_weights: Any) -> list[float]:
        if loss_weights is None:
            return [1.0] * self.num_terms
        if not self.nested:
            raise UserError(
                "loss_weights weigh the losses of several outputs: pass loss_fn nested like them too"
            )
        try:
            tf.nest.assert_same_structure(self.loss_fn, loss_weights)
        except (ValueError, TypeError):
            raise UserError(
                f"loss_weights={loss_weights!r} must be nested like loss_fn ({describe_structure(self.loss_fn)})"
            ) from None
        weights = [float(w) for w in tf.nest.flatten(loss_weights)]
        bad = [w for w in weights if not math.isfinite(w) or w < 0]
        if bad:
            raise UserError(f"loss_weights must be finite and not negative, got {bad[0]}")
        return weights

    def terms(self, labels: Any, outputs: Any, sample_weight: Any = None) -> list[LossTerm]:
        """The loss terms of one batch, one an output (one for a single callable)."""
        if not self.nested:
            mask = None if tf.nest.is_nested(outputs) else keras_mask(outputs)
            return [_term(self._losses[0], labels, outputs, sample_weight, mask)]
        if self.same_labels:
            flat_outputs = tf.nest.flatten(outputs)
            if len(flat_outputs) != self.num_terms:
                raise UserError(
                    f"the model returns {len(flat_outputs)} outputs, not the {self.num_terms} expected"
                )
            return [
                _term(loss, labels, output, sample_weight, keras_mask(output))
                for loss, output in zip(self._losses, flat_outputs, strict=True)
            ]
        flat_outputs = _flatten_like(self.loss_fn, outputs, "outputs")
        flat_labels = _flatten_like(self.loss_fn, labels, "labels")
        flat_weights = (
            _flatten_like(self.loss_fn, sample_weight, "sample weights")
            if tf.nest.is_nested(sample_weight)
            else [sample_weight] * self.num_terms
        )
        return [
            _term(loss, label, output, weight, keras_mask(output))
            for loss, label, output, weight in zip(
                self._losses, flat_labels, flat_outputs, flat_weights, strict=True
            )
        ]

    def combine(self, terms: Sequence[LossTerm], counts: Sequence[tf.Tensor]) -> tf.Tensor:
        """sum_k weight_k * total_k / count_k: this replica's share of the loss, given each
        term's count over the global batch (0 real elements: 0)."""
        return tf.add_n(
            [
                weight * tf.math.divide_no_nan(term.total, count)
                for weight, term, count in zip(self.weights, terms, counts, strict=True)
            ]
        )


def check_per_element(loss: Any) -> None:
    """A Keras loss object reduces its batch to one number by default; the engine needs the
    per-element losses to average them over the global batch (and the eval set) itself."""
    if isinstance(loss, keras.losses.Loss) and loss.reduction not in (None, "none"):
        raise UserError(
            f"loss_fn={type(loss).__name__}(reduction={loss.reduction!r}) reduces the batch to one "
            f"number; pass {type(loss).__name__}(..., reduction=None) so that the engine gets per-element "
            "losses and averages them over the global batch"
        )
    if not callable(loss):
        raise UserError(f"loss_fn must be callable (or callables nested like the outputs), got {loss!r}")


def _term(loss: PerElementLoss, labels: Any, outputs: Any, sample_weight: Any, mask: Any) -> LossTerm:
    values = tf.cast(user_code(loss)(labels, outputs), tf.float32)
    if values.shape.rank == 0:
        raise UserError(
            f"loss_fn returned one number for the batch ({getattr(loss, '__name__', type(loss).__name__)}); "
            "return one loss per example (or per element), unreduced: the engine averages them"
        )
    weight = None
    mask_weight = _like(mask, values) if mask is not None else None
    if mask_weight is not None:
        weight = mask_weight
    if sample_weight is not None:
        sample = _like(sample_weight, values)
        if sample is None:
            raise UserError(
                f"sample weights of shape {sample_weight.shape} do not fit losses of shape {values.shape}: "
                "give one weight per example or per element"
            )
        weight = sample if weight is None else weight * sample
    total = tf.reduce_sum(values if weight is None else values * weight)
    if mask_weight is not None:
        count = tf.reduce_sum(tf.broadcast_to(mask_weight, tf.shape(values)))
        per_example = None
    else:
        count = tf.cast(tf.size(values), tf.float32)
        inner = values.shape[1:]
        per_example = inner.num_elements() if inner.is_fully_defined() else None
    return LossTerm(total=total, count=tf.stop_gradient(count), per_example=per_example)


def _like(weight: Any, values: tf.Tensor) -> tf.Tensor | None:
    """`weight` (a mask or sample weights) as float32 broadcastable to `values`, Keras's
    `squeeze_or_expand_to_same_rank`: a trailing axis of 1 squeezed, missing trailing axes
    added. None where it cannot apply: a mask of higher rank than losses reduced by the loss
    itself (over time: that loss applies it itself, and counts examples)."""
    weight = tf.cast(weight, tf.float32)
    rank, target = weight.shape.rank, values.shape.rank
    if rank is None or target is None:
        return weight
    if rank == target + 1 and weight.shape[-1] == 1:
        return tf.squeeze(weight, -1)
    if rank > target:
        return None
    while rank < target:
        weight = tf.expand_dims(weight, -1)
        rank += 1
    return weight


def _flatten_like(structure: Any, values: Any, what: str) -> list[Any]:
    try:
        tf.nest.assert_same_structure(structure, values, check_types=False)
        return tf.nest.flatten(values)
    except (ValueError, TypeError):
        raise UserError(
            f"the {what} ({describe_structure(values)}) are not nested like loss_fn "
            f"({describe_structure(structure)}): give one loss per output, keyed or ordered as the outputs"
        ) from None


def describe_structure(value: Any) -> str:
    """How a batch, its labels or outputs are nested, for messages."""
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(value)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return "one tensor" if tf.is_tensor(value) else f"a {type(value).__name__}"


class EvalLoss(keras.metrics.Metric):
    """The evaluation's loss over a whole eval set: each term's sum(w * l) over its real
    elements divided by their number (not a mean of batch means: a batch of few real
    tokens weighs what it holds), weighted; plus the regularization loss, averaged over the
    examples as Keras `evaluate` adds it. Its sums add up over replicas when read."""

    def __init__(self, objective: Objective, name: str = "loss"):
        super().__init__(name=name)
        self.loss_weights = list(objective.weights)
        terms = objective.num_terms
        self.totals = self.add_variable(shape=(terms,), initializer="zeros", name="totals")
        self.counts = self.add_variable(shape=(terms,), initializer="zeros", name="counts")
        self.regularization = self.add_variable(shape=(), initializer="zeros", name="regularization")
        self.examples = self.add_variable(shape=(), initializer="zeros", name="examples")

    def update_state(self, terms: Sequence[LossTerm], regularization: tf.Tensor, examples: tf.Tensor) -> None:  # type: ignore[override]
        self.totals.assign_add(tf.stack([term.total for term in terms]))
        self.counts.assign_add(tf.stack([term.count for term in terms]))
        self.regularization.assign_add(tf.cast(regularization, tf.float32) * examples)
        self.examples.assign_add(examples)

    def term_results(self) -> tf.Tensor:
        """Each output's own loss over the eval set (unweighted, as Keras reports `<name>_loss`)."""
        return tf.math.divide_no_nan(self.totals, self.counts)

    def examples_seen(self) -> tf.Tensor:
        """The examples counted so far, over every replica (the evaluation's `num_examples`)."""
        return tf.convert_to_tensor(self.examples)

    def result(self) -> tf.Tensor:
        weights = tf.constant(self.loss_weights, tf.float32)
        data = tf.reduce_sum(weights * tf.math.divide_no_nan(self.totals, self.counts))
        return data + tf.math.divide_no_nan(self.regularization, self.examples)

    def reset_state(self) -> None:
        for variable in self.variables:
            variable.assign(tf.zeros_like(variable))
