"""`--dataset=package.module:function`: a user's own data from code.

The function is called with no arguments and returns either an
`input.DataSource` (used as it is: the way to stream data that does not fit
in memory, with its own exact resume), or `(train, eval)` where each is a
finite `tf.data.Dataset` of unbatched `(features, labels)` examples (eval may
be None). Datasets are read once into memory, so that the engine shuffles,
batches, shards and resumes them exactly (`input.arrays`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from engine.user_code import UserCodeError, exited, first_line, import_callable
from input.arrays import source_from_arrays
from input.errors import DataError
from input.source import DataSource

# A dataset read into memory may take at most this many bytes (features and labels).
MAX_IN_MEMORY_BYTES = 8 * 2**30
_READ_BATCH = 4096


def load_user_data(name: str, options) -> DataSource:
    """The source of `name`'s function; `options` (DataOptions) says how labels are read."""
    try:
        function, where = import_callable(name, setting="dataset")
    except UserCodeError as error:
        raise DataError(str(error)) from None
    return as_data_source(function, options, name=name, where=f"--dataset={name} ({where})")


def as_data_source(data: Any, options, *, name: str, where: str) -> DataSource:
    """`data` as a DataSource: one as it is, (train, eval) datasets read into memory (as the
    source `name`), or a function returning either (called with no arguments); `where` names
    it in errors."""
    if callable(data) and not isinstance(data, (DataSource, tf.data.Dataset)):
        try:
            data = data()
        except SystemExit as error:  # It ended nothing: the run ends with one line instead.
            raise DataError(f"{where} {exited(error, 'its data')}") from None
        except Exception as error:  # Whatever the user's function raises.
            raise DataError(f"{where} raised {type(error).__name__}: {first_line(error)}") from None
    if isinstance(data, DataSource):
        return data
    if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], tf.data.Dataset)):
        raise DataError(
            f"{where} gave {type(data).__name__}; give (train, eval) tf.data.Datasets of "
            "unbatched (features, labels) examples (eval may be None), or an input.DataSource"
        )
    train, evaluation = data
    if evaluation is not None and not isinstance(evaluation, tf.data.Dataset):
        kind = type(evaluation).__name__
        raise DataError(f"{where}: its eval split is a {kind}, not a tf.data.Dataset")
    train_arrays = read_examples(train, f"{where} train")
    eval_arrays = None if evaluation is None else read_examples(evaluation, f"{where} eval")
    return source_from_arrays(
        name, train_arrays, eval_arrays, label_kind=options.label_kind, num_classes=options.num_classes
    )


def read_examples(dataset: tf.data.Dataset, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of every example of a finite dataset of unbatched pairs."""
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and all(isinstance(s, tf.TensorSpec) for s in spec)):
        raise DataError(
            f"{where}: elements are {spec}; yield (features, labels) pairs of tensors (one tensor of features)"
        )
    features_spec, _ = spec
    if features_spec.shape.rank and features_spec.shape[0] is None:
        raise DataError(
            f"{where}: features of shape {features_spec.shape} look batched; return unbatched examples "
            "(the engine batches them at --global_batch_size)"
        )
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise DataError(
            f"{where} is infinite (a repeat()?); return one epoch of examples: the engine repeats and shuffles"
        )
    features, labels, size = [], [], 0
    try:
        for batch_features, batch_labels in dataset.batch(_READ_BATCH).as_numpy_iterator():
            features.append(batch_features)
            labels.append(batch_labels)
            size += batch_features.nbytes + batch_labels.nbytes
            if size > MAX_IN_MEMORY_BYTES:
                raise DataError(
                    f"{where} holds more than {MAX_IN_MEMORY_BYTES / 2**30:.0f} GiB; return an "
                    "input.DataSource that streams it (README: your own data from code)"
                )
    except tf.errors.OpError as error:
        raise DataError(f"{where}: reading it failed: {first_line(error)}") from None
    if not features:
        raise DataError(f"{where} holds no examples")
    return np.concatenate(features), np.concatenate(labels)
