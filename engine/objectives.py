"""Losses and metrics by Keras name, for models that output logits (or raw values).

What `--loss`/`--metrics` and `engine.Task(loss="mse", metrics=["mae"])` resolve
to. The engine's models end in a linear layer: class scores are logits and
regression outputs are the values themselves. So:

- a loss is Keras's, per example (`reduction=None`; the engine averages over
  the global batch), `from_logits=True` for the cross-entropies;
- a metric sees what a Keras user with a softmax/sigmoid output layer would
  give it: probabilities for the classification kinds, the outputs as they
  are for values; labels as the loss reads them.

The label kinds are input.labels': "classes" (int class ids), "multi_label"
(0/1 labels, one sigmoid output each; binary is one such label), "values".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from engine import compat
from engine.errors import UserError

CLASSES, MULTI_LABEL, VALUES = "classes", "multi_label", "values"

# Keras name -> (the label kind it reads, the per-example loss).
_LOSSES: dict[str, tuple[str, Callable[[], keras.losses.Loss]]] = {
    "sparse_categorical_crossentropy": (
        CLASSES,
        lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
    ),
    "categorical_crossentropy": (
        CLASSES,
        lambda: keras.losses.CategoricalCrossentropy(from_logits=True, reduction=None),
    ),
    "binary_crossentropy": (
        MULTI_LABEL,
        lambda: keras.losses.BinaryCrossentropy(from_logits=True, reduction=None),
    ),
    "binary_focal_crossentropy": (
        MULTI_LABEL,
        lambda: keras.losses.BinaryFocalCrossentropy(from_logits=True, reduction=None),
    ),
    "mean_squared_error": (VALUES, lambda: keras.losses.MeanSquaredError(reduction=None)),
    "mean_absolute_error": (VALUES, lambda: keras.losses.MeanAbsoluteError(reduction=None)),
    "huber": (VALUES, lambda: keras.losses.Huber(reduction=None)),
    "log_cosh": (VALUES, lambda: keras.losses.LogCosh(reduction=None)),
    "mean_squared_logarithmic_error": (
        VALUES,
        lambda: keras.losses.MeanSquaredLogarithmicError(reduction=None),
    ),
    "mean_absolute_percentage_error": (
        VALUES,
        lambda: keras.losses.MeanAbsolutePercentageError(reduction=None),
    ),
}
_LOSS_ALIASES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "msle": "mean_squared_logarithmic_error",
    "mape": "mean_absolute_percentage_error",
    "huber_loss": "huber",
    "logcosh": "log_cosh",
}
LOSS_NAMES = tuple(_LOSSES) + tuple(_LOSS_ALIASES)
DEFAULT_LOSSES = {CLASSES: "sparse_categorical_crossentropy", MULTI_LABEL: "binary_crossentropy", VALUES: "mse"}
DEFAULT_METRICS = {CLASSES: ("accuracy",), MULTI_LABEL: ("accuracy",), VALUES: ("mae",)}


def loss_kind(name: str) -> str:
    """The label kind the loss `name` reads; UserError for a name it does not know."""
    return _LOSSES[_loss_name(name)][0]


def _loss_name(name: str) -> str:
    resolved = _LOSS_ALIASES.get(name, name)
    if resolved not in _LOSSES:
        raise UserError(f"unknown `loss={name!r}`; choose one of: {', '.join(LOSS_NAMES)}")
    return resolved


class PerExampleLoss:
    """A Keras loss by name as the Trainer's `loss_fn(labels, outputs) -> (batch, ...)` (one loss
    an example, or an element: a tag per token), labels
    brought to what it reads: one-hot for categorical_crossentropy, the outputs' shape and
    dtype for the binary and value losses."""

    def __init__(self, name: str, num_outputs: int):
        self.name = _loss_name(name)
        self.kind, make = _LOSSES[self.name]
        self.num_outputs = num_outputs
        self._loss = make()

    @compat.engine_graph_code
    def __call__(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        return self._loss(
            as_loss_labels(labels, outputs, self.kind, one_hot=self.name.startswith("categorical")), outputs
        )

    def __repr__(self) -> str:
        return f"PerExampleLoss({self.name!r})"


def as_loss_labels(labels: tf.Tensor, outputs: tf.Tensor, kind: str, *, one_hot: bool = False) -> tf.Tensor:
    """Labels as a loss or metric of `kind` compares them with `outputs`."""
    if kind == CLASSES:
        return (
            tf.one_hot(tf.cast(labels, tf.int32), tf.shape(outputs)[-1], dtype=outputs.dtype)
            if one_hot
            else labels
        )
    return tf.reshape(tf.cast(labels, outputs.dtype), tf.shape(outputs))


class OnProbabilities(keras.metrics.Metric):
    """A Keras metric fed probabilities (softmax of class logits, sigmoid of binary ones) and
    labels as the loss reads them, so that it means what it means in Keras. A metric that makes
    its variables on its first update (R2Score, F1Score) makes them here, for `num_outputs`
    outputs: inside a distributed step they could not be made."""

    def __init__(self, metric: keras.metrics.Metric, kind: str, num_outputs: int = 1):
        super().__init__(name=metric.name)
        self.metric = metric
        self.kind = kind
        self.num_outputs = num_outputs
        if compat.metric_unbuilt(metric):
            outputs = (None, num_outputs)
            compat.build_metric(metric, (None,) if kind == CLASSES else outputs, outputs)

    @compat.engine_graph_code
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        if tf.nest.is_nested(y_pred):  # A model of several outputs (an auxiliary head): the first.
            y_pred = tf.nest.flatten(y_pred)[0]
        mask = compat.keras_mask(y_pred)  # Padding (a masked sequence) is left out, as Keras leaves it.
        if self.kind == CLASSES:
            y_pred = tf.nn.softmax(y_pred)
        elif self.kind == MULTI_LABEL:
            y_pred = tf.sigmoid(y_pred)
        if mask is not None:
            compat.set_keras_mask(y_pred, mask)
        return self.metric.update_state(as_loss_labels(y_true, y_pred, self.kind), y_pred, sample_weight)

    def result(self) -> Any:
        return self.metric.result()

    def reset_state(self) -> None:
        self.metric.reset_state()

    def get_config(self) -> dict[str, Any]:
        """What `from_config` rebuilds it from (the engine makes fresh copies per evaluation)."""
        return {"metric": self.metric, "kind": self.kind, "num_outputs": self.num_outputs}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OnProbabilities:
        metric = config["metric"]
        return cls(type(metric).from_config(metric.get_config()), config["kind"], config.get("num_outputs", 1))


def build_metric(name: str, kind: str, num_outputs: int) -> keras.metrics.Metric:
    """The metric `name` for labels of `kind`: the engine's table of the common names (with a
    meaning for each kind), else any name `keras.metrics.get` knows. Reported under `name`."""
    table: dict[str, dict[str, Callable[[], keras.metrics.Metric]]] = {
        "accuracy": {
            CLASSES: lambda: keras.metrics.SparseCategoricalAccuracy(name=name),
            MULTI_LABEL: lambda: keras.metrics.BinaryAccuracy(name=name),
        },
        "top_5_accuracy": {CLASSES: lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=5, name=name)},
        "auc": {MULTI_LABEL: lambda: keras.metrics.AUC(name=name, multi_label=num_outputs > 1)},
        "precision": {MULTI_LABEL: lambda: keras.metrics.Precision(name=name)},
        "recall": {MULTI_LABEL: lambda: keras.metrics.Recall(name=name)},
        "mae": {VALUES: lambda: keras.metrics.MeanAbsoluteError(name=name)},
        "mse": {VALUES: lambda: keras.metrics.MeanSquaredError(name=name)},
        "rmse": {VALUES: lambda: keras.metrics.RootMeanSquaredError(name=name)},
        "r2": {VALUES: lambda: keras.metrics.R2Score(name=name)},
    }
    if name in table:
        by_kind = table[name]
        if kind not in by_kind:
            raise UserError(
                f"metric {name!r} has no meaning for {kind} labels; it is for {' or '.join(by_kind)} labels"
            )
        return OnProbabilities(by_kind[kind](), kind, num_outputs)
    try:
        found = keras.metrics.get(name)
    except ValueError:
        raise UserError(
            f"unknown metric {name!r}; use one of {', '.join(table)} or a keras.metrics name"
        ) from None
    if isinstance(found, type):
        found = found()
    metric = (
        found if isinstance(found, keras.metrics.Metric) else keras.metrics.MeanMetricWrapper(found, name=name)
    )
    return OnProbabilities(metric, kind, num_outputs)
