"""MNIST from a local mnist.npz only: the machines that run this project have
no network, so a download attempt would hang or fail with a confusing error."""

from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np
import tensorflow as tf

from input.errors import DataError
from input.files import check_npz_sizes
from input.images import fit_images
from input.in_memory import InMemorySource
from input.labels import classes

FILE_NAME = "mnist.npz"  # the file keras.datasets.mnist.load_data() caches
_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _keras_cache_dir() -> str:
    """Where keras.datasets caches files; read at call time (not Keras' import
    time) so that HOME/KERAS_HOME changes are honoured."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets")


def find_mnist(data_dir: str | None) -> str:
    """Path of an existing mnist.npz: `data_dir` (a directory or the file
    itself) first, then the Keras cache."""
    candidates = []
    if data_dir is not None:
        candidates.append(data_dir if data_dir.endswith(".npz") else os.path.join(data_dir, FILE_NAME))
    cache_dir = _keras_cache_dir()
    candidates.append(os.path.join(cache_dir, FILE_NAME))
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise DataError(
        f"MNIST is not available offline: no {FILE_NAME} in {cache_dir} or "
        f"--data_dir={data_dir}; copy {FILE_NAME} there, or use --dataset=digits "
        "(real handwritten digits bundled with scikit-learn) or --dataset=synthetic"
    )


def _fit_uint8(images: np.ndarray, image_shape: tuple[int, int, int]) -> np.ndarray:
    """(N, 28, 28) uint8 -> (N, H, W, C) uint8; kept uint8 to keep memory 4x
    smaller than float32 (resized pixels are rounded to 1/255 steps)."""
    height, width, channels = image_shape
    images = images[..., np.newaxis]
    if images.shape[1:3] != (height, width):
        resized = fit_images(tf.constant(images.astype(np.float32) / 255.0), (height, width, 1))
        images = tf.cast(tf.round(resized * 255.0), tf.uint8).numpy()
    # Grayscale to C channels in uint8: 4x less memory traffic than in float.
    return np.repeat(images, channels, axis=-1) if channels != 1 else images


def _check_arrays(path: str, arrays: dict[str, np.ndarray], num_classes: int) -> None:
    """Shapes and label range, checked up front: a wrong shape would fail deep
    inside TensorFlow, and a label >= num_classes would train on a silent NaN loss."""
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if images.ndim != 3 or images.shape[1:] != (28, 28) or len(images) == 0 or images.dtype != np.uint8:
            raise DataError(
                f"{path}: x_{split} is {images.dtype} of shape {images.shape}; expected "
                "(N, 28, 28) uint8 grayscale images as in keras.datasets.mnist"
            )
        if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(
                f"{path}: y_{split} is {labels.dtype} of shape {labels.shape}; expected "
                f"{len(images)} integer labels, one per image of x_{split}"
            )
        if labels.min() < 0 or labels.max() >= num_classes:
            bad = int(np.flatnonzero((labels < 0) | (labels >= num_classes))[0])
            raise DataError(
                f"{path}: y_{split}[{bad}] = {int(labels[bad])} is not a class of "
                f"0..{num_classes - 1}; fix the file"
            )


def load_mnist(image_shape: tuple[int, int, int], num_classes: int, data_dir: str | None) -> InMemorySource:
    """The 60,000/10,000 split of the file."""
    if num_classes != 10:
        raise DataError(f"mnist has 10 classes, got num_classes={num_classes}; use 10")
    path = find_mnist(data_dir)
    check_npz_sizes(path, _KEYS, where=f"MNIST's file {path}")
    try:
        with np.load(path) as data:
            arrays = {key: data[key] for key in _KEYS}
    except (
        OSError,
        KeyError,
        ValueError,
        EOFError,
        zipfile.BadZipFile,
        zlib.error,
    ) as err:  # Damaged or no npz.
        raise DataError(
            f"cannot read MNIST from {path}: {type(err).__name__}: {err}; expected the mnist.npz of "
            "keras.datasets.mnist (x_train, y_train, x_test, y_test): copy it again or remove it"
        ) from None
    _check_arrays(path, arrays, num_classes)
    return InMemorySource.from_arrays(
        "mnist",
        classes(num_classes),
        train=(_fit_uint8(arrays["x_train"], image_shape), arrays["y_train"]),
        eval_split=(_fit_uint8(arrays["x_test"], image_shape), arrays["y_test"]),
    )
