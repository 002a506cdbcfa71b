"""Name -> data source table, so the engine picks a data set by a flag value."""

from __future__ import annotations

from collections.abc import Callable

from input.digits import load_digits
from input.errors import DataError
from input.mnist import load_mnist
from input.source import DataSource
from input.synthetic import load_synthetic
from input.tfrecord import load_tfrecord

# Each loader: (image_shape, num_classes, data_dir) -> DataSource.
_LOADERS: dict[str, Callable[[tuple[int, int, int], int, str | None], DataSource]] = {
    "digits": lambda shape, classes, _: load_digits(shape, classes),
    "mnist": load_mnist,
    "synthetic": lambda shape, classes, _: load_synthetic(shape, classes),
    "tfrecord": load_tfrecord,
}


def dataset_names() -> list[str]:
    """Known data set names, the offline default (digits) first."""
    return list(_LOADERS)


def get_data_source(
    name: str,
    *,
    image_shape: tuple[int, int, int],
    num_classes: int = 10,
    data_dir: str | None = None,
) -> DataSource:
    """Load (or, for tfrecord, check) the named data set at `image_shape`.

    Raises DataError with a one-line, user-facing message on any data problem.
    """
    loader = _LOADERS.get(name)
    if loader is None:
        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(_LOADERS)}")
    shape = tuple(int(d) for d in image_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise DataError(
            f"image_shape must be (height, width, channels) of positive sizes, "
            f"got {shape}; models with a flat input cannot take images"
        )
    height, width, channels = shape
    return loader((height, width, channels), num_classes, data_dir)
