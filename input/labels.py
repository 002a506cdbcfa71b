"""What a data set's labels are: class ids, several 0/1 labels, or values.

The label kind decides the default loss and metrics, the model's output size
and how labels are checked, so it is found once, from the data, before any
model is built: integer labels of shape (N,) are class ids, except a column
holding only 0 and 1, which is one binary label (binary cross-entropy, a
sigmoid's AUC); integer or boolean labels of shape (N, k) holding only 0 and
1 are k binary labels (multi-label); float labels are values to regress.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from input.errors import DataError

CLASSES = "classes"
MULTI_LABEL = "multi_label"
VALUES = "values"
LABEL_KINDS = (CLASSES, MULTI_LABEL, VALUES)
# More classes than this from integer labels is almost always a regression target
# (a price, a count) read as class ids: refused with a hint instead of a huge softmax.
MAX_INFERRED_CLASSES = 10_000


@dataclass(frozen=True)
class LabelSpec:
    """The labels of one example.

    `kind`: one of LABEL_KINDS; `width`: the number of classes (classes), of
    binary labels (multi_label) or of values (values; 1 for a scalar);
    `shape`: one example's label shape, () or (k,).
    """

    kind: str
    width: int
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LABEL_KINDS:
            raise ValueError(f"label kind {self.kind!r} is not one of {LABEL_KINDS}")
        if self.width < 1:
            raise ValueError(f"a label width must be at least 1, got {self.width}")

    @property
    def num_classes(self) -> int | None:
        return self.width if self.kind == CLASSES else None

    @property
    def dtype(self) -> str:
        """How the labels are stored: class ids as int32, everything else as float32."""
        return "int32" if self.kind == CLASSES else "float32"

    def describe(self) -> str:
        return {
            CLASSES: f"{self.width} classes" + (f" for each of {self.shape[0]} elements" if self.shape else ""),
            MULTI_LABEL: f"{self.width} binary labels",
            VALUES: f"{self.width} value(s)" if self.shape else "one value",
        }[self.kind]


def classes(num_classes: int) -> LabelSpec:
    return LabelSpec(CLASSES, num_classes)


def infer_labels(labels: np.ndarray, where: str, *, num_classes: int | None = None) -> LabelSpec:
    """The LabelSpec of a split's labels (N,) or (N, k), checked; `where` names them
    in errors. `num_classes` (when known) wins over the largest label + 1."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1 and not np.issubdtype(labels.dtype, np.floating):
        labels = labels[:, 0]
    if labels.ndim not in (1, 2) or len(labels) == 0:
        raise DataError(f"{where}: labels must have shape (N,) or (N, k), got {labels.shape}")
    if labels.ndim == 2 and labels.shape[1] == 0:
        raise DataError(f"{where}: labels of shape {labels.shape} hold no value an example")
    if np.iscomplexobj(labels) or not (np.issubdtype(labels.dtype, np.number) or labels.dtype == np.bool_):
        raise DataError(f"{where}: labels must be real numbers, got {labels.dtype}")
    if not np.isfinite(labels.astype(np.float64)).all():
        raise DataError(f"{where}: labels hold NaN or Inf values; remove those examples")
    integral = labels.dtype == np.bool_ or np.issubdtype(labels.dtype, np.integer)
    if labels.ndim == 2:
        binary = integral and set(np.unique(labels).tolist()) <= {0, 1}
        kind = MULTI_LABEL if binary else VALUES
        return LabelSpec(kind, int(labels.shape[1]), (int(labels.shape[1]),))
    if not integral:
        return LabelSpec(VALUES, 1)
    smallest, largest = int(labels.min()), int(labels.max())
    if smallest < 0:
        raise DataError(
            f"{where}: label {smallest} is negative; class ids are 0..C-1 (for a regression, store the labels "
            "as floats or pass --loss=mse)"
        )
    if num_classes is not None:
        if largest >= num_classes:
            raise DataError(f"{where}: label {largest} is not a class of 0..{num_classes - 1}")
        return classes(num_classes)
    if largest <= 1:  # A yes/no column: one binary label, as a class-id loss can still read it.
        return LabelSpec(MULTI_LABEL, 1)
    if largest + 1 > MAX_INFERRED_CLASSES:
        raise DataError(
            f"{where}: integer labels up to {largest} would be {largest + 1} classes; for a regression store "
            "the labels as floats or pass --loss=mse"
        )
    return classes(max(largest + 1, 2))


def check_same_labels(train: LabelSpec, other: LabelSpec, where: str) -> LabelSpec:
    """The eval split's labels must be of the train split's kind; classes take the larger count."""
    if train.kind != other.kind or (train.kind != CLASSES and train.shape != other.shape):
        raise DataError(
            f"{where}: labels are {other.describe()} ({other.kind}) but the train split's are "
            f"{train.describe()} ({train.kind}); give both splits labels of one kind"
        )
    return classes(max(train.width, other.width)) if train.kind == CLASSES else train
