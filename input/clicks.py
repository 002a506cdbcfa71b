"""Synthetic click logs: the offline example of a model with large embedding tables
(`--dataset=clicks`, for `--model=wide_deep`, see docs/several-machines.md).

Each example has `NUM_DENSE` numeric features and `NUM_CATEGORICAL` categorical ones, each
hashed into one id space of `vocab_size` ids (`--vocab_size`, `VOCAB_SIZE` by default; as a
recommender hashes user, item and context features into its tables), stored after the
numbers as float32 columns (exact: every id is below 2**24). Ids are drawn with a long tail,
as real ones are: a few are frequent, most rare. The 0/1 label is drawn from a logistic
model of a weighted sum of the numbers and of one hidden effect per id, so a model that
learns the ids' rows beats one that sees the numbers alone. Deterministic: the data never
change with --seed.
"""

from __future__ import annotations

import numpy as np

from input.in_memory import InMemorySource
from input.labels import MULTI_LABEL, LabelSpec

NUM_DENSE = 4
NUM_CATEGORICAL = 6
VOCAB_SIZE = 100_000
MAX_VOCAB_SIZE = 1 << 24  # Ids are stored in float32 columns: exact up to 2**24.
NUM_TRAIN = 20_000
NUM_EVAL = 4_003  # Not a multiple of common batch sizes: the last batch is partial.
_SEED = 20261203
_VALUES_PER_FEATURE = 2_000  # Distinct values of each categorical feature before hashing.


def load_clicks(vocab_size: int = VOCAB_SIZE) -> InMemorySource:
    """`NUM_TRAIN` train and `NUM_EVAL` eval examples of `NUM_DENSE + NUM_CATEGORICAL` columns,
    the ids in [0, `vocab_size`) (the same data as ever at the default)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"clicks: vocab_size={vocab_size!r} must be a whole number in [1, {MAX_VOCAB_SIZE}]")
    rng = np.random.RandomState(_SEED)
    dense_weights = rng.normal(0, 0.6, NUM_DENSE)
    id_effects = rng.normal(0, 0.8, vocab_size)
    # Each (feature, value) pair hashes to one id, with a multiplicative hash spreading features apart.
    hashes = (
        np.arange(NUM_CATEGORICAL)[:, None] * 1_000_003 + np.arange(_VALUES_PER_FEATURE)[None, :] * 2_654_435_761
    ) % vocab_size

    def split(count: int) -> tuple[np.ndarray, np.ndarray]:
        numbers = rng.normal(0, 1, (count, NUM_DENSE))
        values = (rng.zipf(1.2, (count, NUM_CATEGORICAL)) - 1) % _VALUES_PER_FEATURE  # A long tail.
        ids = hashes[np.arange(NUM_CATEGORICAL)[None, :], values]
        logits = numbers @ dense_weights + id_effects[ids].sum(axis=1) - 0.5
        clicked = rng.random_sample(count) < 1 / (1 + np.exp(-logits))
        features = np.concatenate([numbers, ids], axis=1).astype(np.float32)
        return features, clicked.astype(np.int32)

    train = split(NUM_TRAIN)
    one_label = LabelSpec(MULTI_LABEL, 1)  # 0/1: binary cross-entropy, a sigmoid's AUC.
    return InMemorySource.from_arrays("clicks", one_label, train=train, eval_split=split(NUM_EVAL))
