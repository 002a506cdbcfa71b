"""Turns the user's training and eval data into distributed datasets.

Three forms are accepted; the first two are tf.distribute's two entry points:

- a `tf.data.Dataset` of GLOBAL batches: split across replicas by
  `strategy.experimental_distribute_dataset`;
- a function `fn(input_context)` returning a dataset of PER-REPLICA
  batches for one input pipeline: called by
  `strategy.distribute_datasets_from_function` once per pipeline;
- a function `fn(start_step)` (that one parameter alone) returning GLOBAL
  batches from that step on: distributed like a dataset.

Resuming needs the data position, which the distributed iterator cannot
save. Training data is therefore rebuilt at the restored global step: a
function that takes a `start_step` argument starts there itself (ideally in
O(1), as the `input` package's sources do); any other form is skipped
forward by `start_step` batches, which is exact for a deterministic
pipeline but replays the skipped batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeAlias

import tensorflow as tf

DatasetFn = Callable[..., tf.data.Dataset]
Data: TypeAlias = tf.data.Dataset | DatasetFn


def _parameter_names(dataset_fn: DatasetFn) -> list[str]:
    try:
        return list(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):
        return []


def takes_start_step(dataset_fn: DatasetFn) -> bool:
    return "start_step" in _parameter_names(dataset_fn)


def yields_global_batches(data: Data) -> bool:
    """True for a dataset, or a function of `start_step` alone."""
    return isinstance(data, tf.data.Dataset) or _parameter_names(data) == ["start_step"]


def distribute_train_data(
    strategy: tf.distribute.Strategy, data: Data, *, start_step: int
) -> tf.distribute.DistributedDataset:
    """Distributes training data positioned at global step `start_step`."""
    if isinstance(data, tf.data.Dataset):
        return strategy.experimental_distribute_dataset(data.skip(start_step))
    if yields_global_batches(data):
        return strategy.experimental_distribute_dataset(data(start_step=start_step))

    return strategy.distribute_datasets_from_function(
        lambda input_context: pipeline_at(data, input_context, start_step=start_step)
    )


def pipeline_at(
    data: DatasetFn, input_context: tf.distribute.InputContext, *, start_step: int
) -> tf.data.Dataset:
    """One input pipeline of a data function, positioned at `start_step`."""
    if yields_global_batches(data):
        return data(start_step=start_step)
    if takes_start_step(data):
        return data(input_context, start_step=start_step)
    return data(input_context).skip(start_step)


def distribute_eval_data(strategy: tf.distribute.Strategy, data: Data) -> tf.distribute.DistributedDataset:
    """Distributes a finite eval set; partial and empty batches are kept."""
    if isinstance(data, tf.data.Dataset):
        return strategy.experimental_distribute_dataset(data)
    return strategy.distribute_datasets_from_function(data)
