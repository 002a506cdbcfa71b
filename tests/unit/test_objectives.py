"""`--loss`/`--metrics` by name mean what they mean in Keras: each loss's mean over a batch
equals Keras `evaluate` of the same model compiled with that loss (on logits where Keras takes
probabilities only through `from_logits`), and each metric equals Keras's on a model whose
last layer applies the softmax/sigmoid the engine's models leave out."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from engine import objectives
from engine.errors import UserError

RNG = np.random.RandomState(0)
X = RNG.normal(size=(48, 5)).astype(np.float32)
CLASS_IDS = RNG.randint(0, 4, size=48)
BINARY = RNG.randint(0, 2, size=(48, 3))
VALUES = RNG.normal(size=(48, 2)).astype(np.float32) + 2.0


def linear(outputs: int, activation=None) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(outputs, activation=activation)(inputs))


# (name, labels given to the engine, labels Keras is given, Keras's loss)
LOSSES = [
    (
        "sparse_categorical_crossentropy",
        CLASS_IDS,
        CLASS_IDS,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ),
    (
        "categorical_crossentropy",
        CLASS_IDS,
        np.eye(4)[CLASS_IDS],
        keras.losses.CategoricalCrossentropy(from_logits=True),
    ),
    ("binary_crossentropy", BINARY, BINARY, keras.losses.BinaryCrossentropy(from_logits=True)),
    ("binary_focal_crossentropy", BINARY, BINARY, keras.losses.BinaryFocalCrossentropy(from_logits=True)),
    ("mse", VALUES, VALUES, "mse"),
    ("mae", VALUES, VALUES, "mae"),
    ("huber", VALUES, VALUES, "huber"),
    ("log_cosh", VALUES, VALUES, "log_cosh"),
    ("msle", VALUES, VALUES, "mean_squared_logarithmic_error"),
    ("mape", VALUES, VALUES, "mean_absolute_percentage_error"),
]


@pytest.mark.parametrize("name,labels,keras_labels,keras_loss", LOSSES, ids=[case[0] for case in LOSSES])
def test_each_loss_by_name_averages_to_keras_evaluate(name, labels, keras_labels, keras_loss):
    width = 4 if objectives.loss_kind(name) == objectives.CLASSES else labels.shape[-1]
    model = linear(width)
    per_example = objectives.PerExampleLoss(name, width)(tf.constant(labels), model(X))
    assert per_example.shape == (len(X),)
    model.compile(loss=keras_loss)
    expected = model.evaluate(X, keras_labels, batch_size=len(X), verbose=0)
    np.testing.assert_allclose(float(tf.reduce_mean(per_example)), expected, rtol=1e-5)


def test_binary_crossentropy_on_one_label_column_of_class_ids():
    labels = BINARY[:, 0]  # (N,) 0/1 class ids, read as one binary label: (N, 1) logits.
    model = linear(1)
    loss = objectives.PerExampleLoss("binary_crossentropy", 1)(tf.constant(labels), model(X))
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    expected = model.evaluate(X, labels[:, None].astype(np.float32), batch_size=len(X), verbose=0)
    np.testing.assert_allclose(float(tf.reduce_mean(loss)), expected, rtol=1e-5)


# (metric, kind, labels, Keras's metric on probabilities)
METRICS = [
    ("accuracy", objectives.CLASSES, CLASS_IDS, "sparse_categorical_accuracy"),
    ("top_5_accuracy", objectives.CLASSES, CLASS_IDS, keras.metrics.SparseTopKCategoricalAccuracy(k=5)),
    ("accuracy", objectives.MULTI_LABEL, BINARY, "binary_accuracy"),
    ("auc", objectives.MULTI_LABEL, BINARY, keras.metrics.AUC(multi_label=True)),
    ("precision", objectives.MULTI_LABEL, BINARY, keras.metrics.Precision()),
    ("recall", objectives.MULTI_LABEL, BINARY, keras.metrics.Recall()),
    ("mae", objectives.VALUES, VALUES, "mae"),
    ("rmse", objectives.VALUES, VALUES, keras.metrics.RootMeanSquaredError()),
    ("r2", objectives.VALUES, VALUES, keras.metrics.R2Score()),
]


@pytest.mark.parametrize("name,kind,labels,keras_metric", METRICS, ids=[f"{m[0]}-{m[1]}" for m in METRICS])
def test_each_metric_by_name_equals_keras_on_probabilities(name, kind, labels, keras_metric):
    width = 4 if kind == objectives.CLASSES else labels.shape[-1]
    activation = {objectives.CLASSES: "softmax", objectives.MULTI_LABEL: "sigmoid"}.get(kind)
    logits_model, probability_model = linear(width), linear(width, activation)
    metric = objectives.build_metric(name, kind, width)
    metric.update_state(tf.constant(labels), logits_model(X))
    loss = "sparse_categorical_crossentropy" if kind == objectives.CLASSES else "mse"  # Not what is compared.
    probability_model.compile(loss=loss, metrics=[keras_metric])
    expected = probability_model.evaluate(X, labels.astype(np.float32), batch_size=len(X), verbose=0)[1]
    assert metric.name == name
    np.testing.assert_allclose(float(metric.result()), expected, rtol=1e-5, atol=1e-6)


def test_names_that_mean_nothing_for_the_labels_are_refused():
    with pytest.raises(UserError, match="metric 'auc' has no meaning for values labels"):
        objectives.build_metric("auc", objectives.VALUES, 1)
    with pytest.raises(UserError, match="unknown `loss='hinge_loss'`"):
        objectives.loss_kind("hinge_loss")
