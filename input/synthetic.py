"""Random images and labels of any shape: for throughput benchmarks (an
in-memory gather is never the bottleneck) and for tests."""

from __future__ import annotations

import numpy as np

from input.errors import DataError
from input.in_memory import InMemorySource
from input.labels import classes

NUM_TRAIN = 1024
NUM_EVAL = 256
_SEED = 12345  # fixed: the data must not change with the run's --seed


def load_synthetic(image_shape: tuple[int, int, int], num_classes: int) -> InMemorySource:
    """Uniform uint8 pixels and uniform labels, generated once."""
    if num_classes < 1:
        raise DataError(f"num_classes must be >= 1, got {num_classes}")
    rng = np.random.RandomState(_SEED)

    def split(size: int) -> tuple[np.ndarray, np.ndarray]:
        images = rng.randint(0, 256, size=(size, *image_shape), dtype=np.uint8)
        labels = rng.randint(0, num_classes, size=size).astype(np.int32)
        return images, labels

    train = split(NUM_TRAIN)
    return InMemorySource.from_arrays("synthetic", classes(num_classes), train=train, eval_split=split(NUM_EVAL))
