"""scikit-learn's handwritten digits: real data that is always available
offline (1,797 8x8 images), the default when MNIST cannot be downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import tensorflow as tf

from input.errors import DataError
from input.images import fit_images
from input.in_memory import InMemorySource
from input.labels import classes

NUM_EVAL = 297  # deliberately not a multiple of common batch sizes
# The held-out split must not depend on the run's --seed, or runs with
# different seeds would evaluate on each other's training examples.
_SPLIT_SEED = 20240229


def load_digits(image_shape: tuple[int, int, int], num_classes: int) -> InMemorySource:
    """1,500 train / 297 eval examples, resized once to `image_shape`."""
    if num_classes != 10:
        raise DataError(f"digits has 10 classes, got num_classes={num_classes}; use 10")
    pixels, labels = _digits_table()
    images = (pixels.reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., np.newaxis]
    labels = labels.astype(np.int32)
    # RandomState, not default_rng: its stream is frozen across NumPy versions.
    order = np.random.RandomState(_SPLIT_SEED).permutation(len(labels))
    images = fit_images(tf.constant(images[order]), image_shape).numpy()
    labels = labels[order]
    return InMemorySource.from_arrays(
        "digits",
        classes(num_classes),
        train=(images[:-NUM_EVAL], labels[:-NUM_EVAL]),
        eval_split=(images[-NUM_EVAL:], labels[-NUM_EVAL:]),
    )


def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """The 64 pixel values (0-16) and the digit of each image, as scikit-learn's `load_digits`
    gives them. Read from the file that `load_digits` reads, without importing
    `sklearn.datasets`: that import costs about a second of every default run's start-up.
    Where a scikit-learn release keeps the file elsewhere, `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")  # Finds the package without importing it.
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")  # As load_digits reads it.
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits as sklearn_load_digits

    digits = sklearn_load_digits()
    return digits.data, digits.target
