"""A data source from NumPy arrays: what .npz and .csv files, tensorflow-datasets
and a user's finite tf.data datasets become once read into memory.

In memory, a batch is gathered by index from (seed, step), so every such
source resumes exactly and can be kept on the devices (`input.in_memory`).
"""

from __future__ import annotations

import numpy as np

from input.errors import DataError
from input.in_memory import InMemorySource
from input.labels import CLASSES, MULTI_LABEL, VALUES, LabelSpec, check_same_labels, infer_labels

# The held-out split of a file without one must not depend on the run's --seed: runs with
# different seeds would evaluate on each other's training examples.
SPLIT_SEED = 20240229


def as_features(features: np.ndarray, where: str) -> np.ndarray:
    """uint8 kept (pixels: scaled by 1/255 when batched, as images are everywhere in the
    engine); other numbers as float32, unscaled."""
    features = np.asarray(features)
    if features.ndim < 2 or len(features) == 0:
        raise DataError(f"{where}: features must have shape (N, ...) with N >= 1, got {features.shape}")
    if 0 in features.shape[1:]:  # Would abort the process inside oneDNN once the model runs.
        raise DataError(f"{where}: features of shape {features.shape} hold no values an example")
    if features.dtype == np.uint8:
        return features
    if np.iscomplexobj(features):  # float32 would keep the real part alone, silently.
        raise DataError(
            f"{where}: features are complex ({features.dtype}); store the real and imaginary parts as "
            "separate values"
        )
    if not (np.issubdtype(features.dtype, np.number) or features.dtype == np.bool_):
        raise DataError(f"{where}: features must be numbers, got {features.dtype}")
    features = features.astype(np.float32)
    if not np.isfinite(features).all():
        row = int(np.flatnonzero(~np.isfinite(features.reshape(len(features), -1)).all(axis=1))[0])
        raise DataError(f"{where}: example {row} holds NaN or Inf features; fix or remove it")
    return features


def labels_as(spec: LabelSpec, kind: str | None, where: str, labels: np.ndarray) -> LabelSpec:
    """The labels as the loss reads them (`kind`, from --loss), checked; None keeps `spec`.

    Any numbers can be regressed; binary losses need labels of 0 and 1 (class ids 0/1 become
    one binary label); one 0/1 label column is two class ids to a class-id loss; class ids
    cannot be made of values.
    """
    if kind is None or kind == spec.kind:
        return spec
    if kind == CLASSES and spec.kind == MULTI_LABEL and spec.width == 1 and labels.ndim == 1:
        return LabelSpec(CLASSES, 2)
    width = 1 if labels.ndim == 1 else int(labels.shape[1])
    shape = () if labels.ndim == 1 else (width,)
    if kind == VALUES:
        return LabelSpec(VALUES, width, shape)
    if kind == MULTI_LABEL:
        values = set(np.unique(labels).tolist())
        if not values <= {0, 1}:
            shown = sorted(values - {0, 1})[:3]
            raise DataError(
                f"{where}: a binary loss takes labels of 0 and 1, but they hold {shown}; use "
                "--loss=sparse_categorical_crossentropy for class ids or --loss=mse for values"
            )
        return LabelSpec(MULTI_LABEL, width, shape)
    if kind == CLASSES and labels.ndim == 2 and np.issubdtype(labels.dtype, np.integer):
        # A class id per element (a tag per token): the model outputs (N, T, classes).
        smallest, largest = int(labels.min()), int(labels.max())
        if smallest < 0:
            raise DataError(f"{where}: label {smallest} is negative; class ids are 0..C-1")
        return LabelSpec(CLASSES, max(largest + 1, 2), (int(labels.shape[1]),))
    raise DataError(
        f"{where}: labels are {spec.describe()} ({spec.kind}), not class ids; use a loss for "
        f"{spec.kind} (see --loss) or store integer class ids"
    )


def split_off_eval(
    features: np.ndarray, labels: np.ndarray, fraction: float, where: str
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """(train, eval) with `fraction` of the examples held out, chosen with a fixed seed;
    fraction 0: no eval split."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"--eval_fraction={fraction} must be in [0, 1)")
    held_out = int(round(len(features) * fraction))
    if fraction == 0.0:
        return (features, labels), None
    if held_out < 1 or held_out >= len(features):
        raise DataError(
            f"{where}: --eval_fraction={fraction} of {len(features)} examples leaves "
            f"{held_out} to evaluate and {len(features) - held_out} to train; both need at least one"
        )
    # RandomState, not default_rng: its stream is frozen across NumPy versions.
    order = np.random.RandomState(SPLIT_SEED).permutation(len(features))
    train, held = order[held_out:], order[:held_out]
    return (features[train], labels[train]), (features[held], labels[held])


def source_from_arrays(
    name: str,
    train: tuple[np.ndarray, np.ndarray],
    eval_split: tuple[np.ndarray, np.ndarray] | None,
    *,
    label_kind: str | None = None,
    num_classes: int | None = None,
) -> InMemorySource:
    """An in-memory source of (features, labels) arrays, checked, labels read as
    `label_kind` (what the loss needs; None: as the data says)."""
    x_train = as_features(train[0], f"{name} train features")
    y_train = np.asarray(train[1])
    if len(y_train) != len(x_train):
        raise DataError(f"{name}: {len(x_train)} train examples but {len(y_train)} labels; give one label each")
    spec = infer_labels(y_train, f"{name} train labels", num_classes=num_classes)
    splits = [(x_train, y_train)]
    if eval_split is not None:
        x_eval = as_features(eval_split[0], f"{name} eval features")
        y_eval = np.asarray(eval_split[1])
        if len(y_eval) != len(x_eval):
            raise DataError(f"{name}: {len(x_eval)} eval examples but {len(y_eval)} labels; give one label each")
        if x_eval.shape[1:] != x_train.shape[1:]:
            raise DataError(
                f"{name}: eval examples of shape {x_eval.shape[1:]} but train examples of shape "
                f"{x_train.shape[1:]}; give both splits one shape"
            )
        eval_spec = infer_labels(y_eval, f"{name} eval labels", num_classes=num_classes or spec.num_classes)
        spec = check_same_labels(spec, eval_spec, name)
        splits.append((x_eval, y_eval))
    converted = labels_as(spec, label_kind, f"{name} labels", y_train)
    if eval_split is not None:
        eval_converted = labels_as(spec, label_kind, f"{name} eval labels", splits[1][1])
        if converted.kind == CLASSES and converted.shape:  # Per-element class ids: the ids of both splits.
            converted = LabelSpec(CLASSES, max(converted.width, eval_converted.width), converted.shape)
    spec = converted
    shaped = [(x, _label_array(y, spec)) for x, y in splits]
    return InMemorySource.from_arrays(name, spec, shaped[0], shaped[1] if eval_split is not None else None)


def _label_array(labels: np.ndarray, spec: LabelSpec) -> np.ndarray:
    labels = np.asarray(labels)
    if spec.kind == CLASSES:
        return labels.reshape((len(labels), *spec.shape)).astype(np.int32)
    return labels.reshape((len(labels), *spec.shape)).astype(np.float32)
