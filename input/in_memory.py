"""Sources whose examples fit in memory (digits, mnist, synthetic, .npz and .csv files): batches are
gathered by index, so the stream position can be computed, not replayed.

Stream position i (0, 1, 2, ...) is example perm(seed, e)[i mod n] with
e = i div n: epochs concatenated, each in its own stateless permutation. A
batch is computed from its step number alone, so `start_step` costs O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from engine.resident import ResidentData, ResidentEvalData, epoch_shuffled, gather_pipeline_options, host_tensor
from input.labels import LabelSpec
from input.source import (
    BatchLayout,
    DataSource,
    InputContext,
    check_stream_args,
)


def _scaled(batch: tuple[tf.Tensor, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """uint8 pixels to float32 in [0, 1]; float32 features as they are."""
    images, labels = batch
    if images.dtype == tf.uint8:
        images = tf.cast(images, tf.float32) / 255.0
    return images, labels


@dataclass(frozen=True)
class InMemorySource(DataSource):
    """Features stored as uint8 (scaled by 1/255 when gathered: pixels) or float32,
    already at `feature_shape`; labels int32 class ids or float32."""

    _train_images: tf.Tensor = field(repr=False, compare=False)
    _train_labels: tf.Tensor = field(repr=False, compare=False)
    _eval_images: tf.Tensor | None = field(repr=False, compare=False)
    _eval_labels: tf.Tensor | None = field(repr=False, compare=False)
    # A table's input.tables.TableSchema: how its raw columns became these features (None: not a table).
    table: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_arrays(
        cls,
        name: str,
        labels: LabelSpec,
        train: tuple[np.ndarray, np.ndarray],
        eval_split: tuple[np.ndarray, np.ndarray] | None,
    ) -> InMemorySource:
        """Build from (features (N, ...), labels (N,) or (N, k)) pairs; labels are stored
        as `labels.dtype`."""
        splits = [train] if eval_split is None else [train, eval_split]
        for features, split_labels in splits:
            if features.ndim < 2 or features.dtype not in (np.uint8, np.float32):
                raise ValueError(
                    f"{name}: features must be uint8 or float32 of shape (N, ...), got "
                    f"{features.dtype} {features.shape}"
                )
            if len(features) != len(split_labels) or len(features) == 0:
                raise ValueError(
                    f"{name}: got {len(features)} examples and {len(split_labels)} labels; "
                    "need the same non-zero number"
                )
            if tuple(split_labels.shape[1:]) != labels.shape:
                raise ValueError(f"{name}: labels of shape {split_labels.shape} are not {labels.describe()}")
        if eval_split is not None and eval_split[0].shape[1:] != train[0].shape[1:]:
            raise ValueError(
                f"{name}: eval features of shape {eval_split[0].shape[1:]} differ from the train split's "
                f"{train[0].shape[1:]}"
            )
        eval_images, eval_labels = (
            (None, None)
            if eval_split is None
            else (host_tensor(eval_split[0]), host_tensor(eval_split[1].astype(labels.dtype)))
        )
        return cls(
            name=name,
            labels=labels,
            feature_shape=tuple(int(d) for d in train[0].shape[1:]),
            num_train_examples=len(train[0]),
            num_eval_examples=None if eval_split is None else len(eval_split[0]),
            _train_images=host_tensor(train[0]),
            _train_labels=host_tensor(train[1].astype(labels.dtype)),
            _eval_images=eval_images,
            _eval_labels=eval_labels,
        )

    @property
    def feature_dtype(self) -> str:
        return "uint8" if self._train_images.dtype == tf.uint8 else "float32"

    def train_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The train split's features and labels as stored (what a table's statistics are taken from)."""
        return self._train_images.numpy(), self._train_labels.numpy()

    @staticmethod
    def _gather_fn(images: tf.Tensor, labels: tf.Tensor) -> Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]:
        """A tf.data map function turning index batches into example batches."""

        def gather(indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return _scaled((tf.gather(images, indices), tf.gather(labels, indices)))

        return gather

    def resident_train_data(self, *, global_batch_size: int, seed: int) -> ResidentData:
        """The training stream of `train_dataset`, as `engine.ResidentData`: the
        split is kept on every replica's device and each batch is gathered there,
        inside the compiled loop, from the same (seed, step) permutation."""
        check_stream_args(seed, 0)
        num_examples = self.num_train_examples
        assert num_examples is not None, "from_arrays sets it: the arrays are in memory"

        def host_data(input_context: tf.distribute.InputContext, start_step: int) -> tf.data.Dataset:
            return self.train_dataset(
                global_batch_size=global_batch_size,
                seed=seed,
                start_step=start_step,
                input_context=input_context,
            )

        return ResidentData(
            tensors=(self._train_images, self._train_labels),
            indices=lambda positions: epoch_shuffled(positions, num_examples, seed),
            host_data=host_data,
            transform=_scaled,
            global_batch_size=global_batch_size,
        )

    def resident_eval_data(self, *, global_batch_size: int, host_data: Any) -> ResidentEvalData | None:
        """The eval split of `eval_dataset` as `engine.ResidentEvalData`: kept on every replica's
        device and read in order there, with no iterator to make at each evaluation."""
        if self.num_eval_examples is None:
            return None
        return ResidentEvalData(
            tensors=(self._eval_images, self._eval_labels),
            host_data=host_data,
            global_batch_size=global_batch_size,
            transform=_scaled,
        )

    def _train_stream(
        self, layout: BatchLayout, *, seed: int, start_step: int, input_context: InputContext | None
    ) -> tf.data.Dataset:
        num_examples = self.num_train_examples
        assert num_examples is not None, "from_arrays sets it: the arrays are in memory"

        def step_indices(step: tf.Tensor) -> tf.Tensor:
            first = step * layout.global_batch_size + layout.offset
            positions = first + tf.range(layout.examples_per_step, dtype=tf.int64)
            indices = epoch_shuffled(positions, num_examples, seed)
            return tf.reshape(indices, [layout.replicas_per_pipeline, layout.per_replica])

        return (
            tf.data.Dataset.counter(start_step, dtype=tf.int64)
            .map(step_indices)
            .unbatch()  # one element per replica, in replica order
            .map(
                self._gather_fn(self._train_images, self._train_labels),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .prefetch(tf.data.AUTOTUNE)
            .with_options(gather_pipeline_options())
        )

    def _eval_batches(self, layout: BatchLayout, input_context: InputContext | None) -> tf.data.Dataset:
        indices = tf.data.Dataset.range(self.num_eval_examples)
        if input_context is not None:
            indices = indices.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return (
            indices.batch(layout.per_replica, drop_remainder=False)
            .map(
                self._gather_fn(self._eval_images, self._eval_labels),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .prefetch(tf.data.AUTOTUNE)
            .with_options(gather_pipeline_options())
        )
