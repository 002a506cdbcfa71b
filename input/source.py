"""The DataSource interface the engine trains from, and the batch-slicing
arithmetic that every source shares.

The training stream is a pure function of (seed, global step): the engine
restarts it at the checkpointed step instead of checkpointing an iterator
(tf.distribute iterators cannot be checkpointed).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import tensorflow as tf

from input.labels import LabelSpec

if TYPE_CHECKING:
    from engine.resident import ResidentData, ResidentEvalData

InputContext: TypeAlias = tf.distribute.InputContext


@dataclass(frozen=True)
class BatchLayout:
    """Which part of every global batch one input pipeline produces.

    Global batch k is examples [k*B, (k+1)*B) of the stream. It is cut into
    `num_replicas` contiguous slices of `per_replica` examples, replica r
    getting slice r; pipeline p owns replicas [p*R/P, (p+1)*R/P), so it reads
    the contiguous range [k*B + offset, k*B + offset + examples_per_step) and
    yields it as `replicas_per_pipeline` per-replica batches.
    """

    global_batch_size: int
    per_replica: int
    replicas_per_pipeline: int
    offset: int

    @property
    def examples_per_step(self) -> int:
        return self.per_replica * self.replicas_per_pipeline


def batch_layout(global_batch_size: int, input_context: tf.distribute.InputContext | None) -> BatchLayout:
    """Validate the batch size against the replicas and compute the slicing."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if input_context is None:
        return BatchLayout(global_batch_size, global_batch_size, 1, 0)
    replicas = input_context.num_replicas_in_sync
    pipelines = input_context.num_input_pipelines
    if global_batch_size % replicas:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by the "
            f"{replicas} replicas in sync; use a multiple of {replicas}"
        )
    if replicas % pipelines:
        raise ValueError(
            f"{replicas} replicas cannot be split evenly over {pipelines} input "
            "pipelines; use the same number of replicas on every worker"
        )
    per_replica = global_batch_size // replicas
    replicas_per_pipeline = replicas // pipelines
    offset = input_context.input_pipeline_id * replicas_per_pipeline * per_replica
    return BatchLayout(global_batch_size, per_replica, replicas_per_pipeline, offset)


def deterministic_options() -> tf.data.Options:
    """Options that keep element order fixed even with parallel maps."""
    options = tf.data.Options()
    options.deterministic = True
    return options


def check_stream_args(seed: int, start_step: int) -> None:
    """Reject arguments that would silently produce a different stream."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be a Python int, got {seed!r}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}; use a smaller seed")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")


@dataclass(frozen=True)
class DataSource(abc.ABC):
    """A named data set with a resumable training stream and an eval split.

    Elements are (features float32, shape (batch, *feature_shape), images in
    [0, 1]; labels of shape (batch, *labels.shape): int32 class ids, else
    float32).
    """

    name: str
    labels: LabelSpec
    feature_shape: tuple[int, ...]  # One example's features, e.g. (H, W, C) of an image.
    num_train_examples: int | None  # None when unknown (tfrecord)
    num_eval_examples: int | None  # None when there is no eval split

    @property
    def num_classes(self) -> int | None:
        """The number of classes of class-id labels; None for other label kinds."""
        return self.labels.num_classes

    @property
    def feature_dtype(self) -> str:
        """How the examples are held before batching: "uint8" pixels (scaled by 1/255 into the
        float32 the model sees) or "float32"; what an export and predict take."""
        return "float32"

    def train_dataset(
        self,
        *,
        global_batch_size: int,
        seed: int,
        start_step: int = 0,
        input_context: tf.distribute.InputContext | None = None,
    ) -> tf.data.Dataset:
        """Infinite stream of batches starting at global step `start_step`.

        Without `input_context`: global batches. With one: this pipeline's
        per-replica batches, in replica order, step after step (see
        `BatchLayout`), as `distribute_datasets_from_function` expects.
        """
        check_stream_args(seed, start_step)
        layout = batch_layout(global_batch_size, input_context)
        return self._train_stream(layout, seed=seed, start_step=start_step, input_context=input_context)

    def eval_dataset(
        self,
        *,
        global_batch_size: int,
        input_context: tf.distribute.InputContext | None = None,
    ) -> tf.data.Dataset | None:
        """Every eval example once in a fixed order, last batch partial; with
        `input_context`, this pipeline's shard in per-replica batches. None
        when the source has no eval split."""
        if self.num_eval_examples is None:
            return None
        return self._eval_batches(batch_layout(global_batch_size, input_context), input_context)

    def resident_train_data(self, *, global_batch_size: int, seed: int) -> ResidentData | None:
        """The training stream as `engine.ResidentData`, kept on every replica's device;
        None (here) for a source that does not hold its train split in memory."""
        return None

    def resident_eval_data(self, *, global_batch_size: int, host_data: Any) -> ResidentEvalData | None:
        """The eval split as `engine.ResidentEvalData`, kept on every replica's device; None (here)
        for a source that does not hold it in memory. `host_data`: the same as an eval form."""
        return None

    @abc.abstractmethod
    def _train_stream(
        self, layout: BatchLayout, *, seed: int, start_step: int, input_context: InputContext | None
    ) -> tf.data.Dataset:
        """`train_dataset`'s stream, for checked arguments and this pipeline's `layout`."""

    @abc.abstractmethod
    def _eval_batches(self, layout: BatchLayout, input_context: InputContext | None) -> tf.data.Dataset:
        """`eval_dataset`'s batches, for a source with an eval split."""


@dataclass(frozen=True)
class DescribedSource(DataSource):
    """A data set known only by what its examples and labels are, without them: what
    `--mode=predict` rebuilds a trained model from (the training data need not exist any
    more). It has no stream and no eval split."""

    stored_dtype: str = "float32"  # "uint8": pixels, as the training held them.

    @property
    def feature_dtype(self) -> str:
        return self.stored_dtype

    def _train_stream(
        self, layout: BatchLayout, *, seed: int, start_step: int, input_context: InputContext | None
    ) -> tf.data.Dataset:
        raise RuntimeError(f"{self.name} describes a data set; it holds no examples to train on")

    def _eval_batches(self, layout: BatchLayout, input_context: InputContext | None) -> tf.data.Dataset:
        raise RuntimeError(f"{self.name} describes a data set; it holds no examples to evaluate")
