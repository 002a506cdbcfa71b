"""`--dataset` value -> data source: a built-in name, a file, tensorflow-datasets, or a
user's function.

- `digits`, `mnist`, `synthetic`: image sets served at the model's input shape;
  `tfrecord`: image TFRecord files in --data_dir, at their own size;
- `PATH.npz`, `PATH.csv`, `PATH.parquet`: a user's arrays or table (`input.files`,
  `input.table_source`);
- `tfds:NAME[/CONFIG]`: a tensorflow-datasets set prepared in --data_dir (`input.tfds_data`);
- `package.module:function`: a user's function returning datasets or a DataSource
  (`input.user_data`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from input.clicks import VOCAB_SIZE, load_clicks
from input.digits import load_digits
from input.errors import DataError
from input.files import is_file_dataset, load_csv, load_npz
from input.mnist import load_mnist
from input.source import DataSource
from input.synthetic import load_synthetic
from input.tfrecord import load_tfrecord

TFDS_PREFIX = "tfds:"


@dataclass(frozen=True)
class DataOptions:
    """How to read a data set, beyond its name (the --dataset flags)."""

    # Images of the built-in sets (and tfrecord, when given) are served at this (H, W, C).
    image_shape: tuple[int, int, int] | None = None
    num_classes: int | None = None  # None: from the data.
    data_dir: str | None = None
    label_column: str | None = None  # .csv
    eval_file: str | None = None  # .csv
    eval_fraction: float = 0.1  # .npz without x_test, .csv without --eval_file
    label_kind: str | None = None  # What the loss reads the labels as; None: as the data says.
    vocab_size: int | None = None  # clicks: the ids' space (None: input.clicks.VOCAB_SIZE).
    column_types: list[str] | None = None  # .csv, .parquet: NAME:TYPE entries (input.tables).


_BUILT_IN: dict[str, Callable[[DataOptions], DataSource]] = {
    "digits": lambda options: load_digits(_image_shape(options), options.num_classes or 10),
    "mnist": lambda options: load_mnist(_image_shape(options), options.num_classes or 10, options.data_dir),
    "synthetic": lambda options: load_synthetic(_image_shape(options), options.num_classes or 10),
    "tfrecord": lambda options: load_tfrecord(options.image_shape, options.num_classes, options.data_dir),
    "clicks": lambda options: load_clicks(options.vocab_size or VOCAB_SIZE),
}
FORMS = ("PATH.npz", "PATH.csv", "PATH.parquet", "tfds:NAME[/CONFIG]", "package.module:function")


def dataset_names() -> list[str]:
    """Known data set names, the offline default (digits) first."""
    return list(_BUILT_IN)


def is_user_data(name: str) -> bool:
    """`package.module:function` (not a file, not tfds:)."""
    return ":" in name and not name.startswith(TFDS_PREFIX) and not is_file_dataset(name)


def check_dataset_name(name: str) -> None:
    """Raises DataError unless `name` is a built-in name or one of the forms of FORMS."""
    if name in _BUILT_IN or is_file_dataset(name) or is_user_data(name):
        return
    if name.startswith(TFDS_PREFIX) and name[len(TFDS_PREFIX) :].strip("/"):
        return
    raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(_BUILT_IN)}, or {', '.join(FORMS)}")


def get_data_source(
    name: str,
    *,
    image_shape: tuple[int, int, int] | None = None,
    num_classes: int | None = None,
    data_dir: str | None = None,
    **options,
) -> DataSource:
    """Load (or, for files streamed from disk, check) the data set `name`; see DataOptions.

    Raises DataError with a one-line, user-facing message on any data problem.
    """
    check_dataset_name(name)
    if image_shape is not None:
        shape = tuple(int(d) for d in image_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise DataError(
                f"image_shape must be (height, width, channels) of positive sizes, "
                f"got {shape}; models with a flat input cannot take images"
            )
        image_shape = (shape[0], shape[1], shape[2])
    request = DataOptions(image_shape=image_shape, num_classes=num_classes, data_dir=data_dir, **options)
    if name in _BUILT_IN:
        return _BUILT_IN[name](request)
    if name.endswith(".npz"):
        return load_npz(
            name,
            eval_fraction=request.eval_fraction,
            label_kind=request.label_kind,
            num_classes=request.num_classes,
        )
    if name.endswith((".csv", ".parquet")):
        table: dict[str, Any] = {
            "label_column": request.label_column,
            "eval_file": request.eval_file,
            "eval_fraction": request.eval_fraction,
            "label_kind": request.label_kind,
            "num_classes": request.num_classes,
            "column_types": request.column_types,
        }
        if name.endswith(".parquet"):
            from input.table_source import load_table

            return load_table(name, **table)
        return load_csv(name, **table)
    if name.startswith(TFDS_PREFIX):
        from input.tfds_data import load_tfds

        return load_tfds(name[len(TFDS_PREFIX) :], request)
    from input.user_data import load_user_data

    return load_user_data(name, request)


def _image_shape(options: DataOptions) -> tuple[int, int, int]:
    if options.image_shape is None:
        raise DataError("the built-in image sets need the image shape to serve their images at")
    return options.image_shape
