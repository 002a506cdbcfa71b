"""Data kept whole on every replica's device, batches gathered inside the compiled loop.

For a data set that fits in device memory, the tf.data iterator is the
largest cost the engine adds to a bare compiled loop on a small model: each
step pulls a batch through the distributed iterator, which splits it and
places each replica's part (figures: benchmarks/RESULTS.md, "Figures behind
the code's choices"). With `ResidentData` the arrays are copied to each
replica's device once, and every step computes its batch from the step
number inside the compiled loop: the same stateless `(seed, step)` stream
the `input` package's tf.data pipelines yield, so a resumed run gets exactly
the batches it would have had, with no iterator at all.

`ResidentEvalData` does the same for an eval split: every evaluation reads
it in order, global batch after global batch, the last one partial, with no
iterator to make: a MirroredStrategy eval iterator traces six functions a
device when it is made, most of an evaluation of a few hundred examples (the
quick start's five evaluations).

Strategies that do not run the loop on the replicas' own devices
(parameter-server training, TPU) train and evaluate from `host_data`, the
same batches through tf.data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from engine.compat import user_code
from engine.data import as_eval_form
from engine.errors import UserError


@dataclass(frozen=True)
class ResidentData:
    """A training split held whole in memory, and the stream of batches drawn from it.

    Global batch k is stream positions [k*B, (k+1)*B) for the global batch
    size B; replica r of R takes the r-th of its R equal slices, as the
    per-replica tf.data path slices it (`input.source.BatchLayout`).

    Args:
      tensors: a nest of host tensors (or arrays), first dimension = examples.
      indices: stream positions (int64 vector) -> example indices (int64),
        e.g. a seeded permutation per epoch; a pure function, so that a
        position means the same example in every run.
      host_data: the same stream in a form `Trainer` takes as `train_data`
        (e.g. `fn(input_context, start_step)`), for strategies that cannot
        keep the tensors on their devices; it must yield the same batches.
      transform: applied to each gathered per-replica batch on its device
        (e.g. uint8 pixels to float32), or None.
      global_batch_size: the batch `host_data` was made for, checked against
        the Trainer's (None: not checked).
    """

    tensors: Any
    indices: Callable[[tf.Tensor], tf.Tensor]
    host_data: Any
    transform: Callable[[Any], Any] | None = field(default=None)
    global_batch_size: int | None = None

    @classmethod
    def shuffled(
        cls,
        tensors: Any,
        *,
        seed: int,
        global_batch_size: int,
        transform: Callable[[Any], Any] | None = None,
    ) -> ResidentData:
        """Arrays (features, labels, ...) drawn in a new seeded order every epoch.

        Stream position i is example `epoch_permutation(seed, i // n)[i % n]`:
        epochs concatenated, a batch may span two. `host_data` is the same stream
        through tf.data, for strategies that cannot keep the arrays on devices.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise ValueError(f"seed must be a Python int that fits in int64, got {seed!r}")
        host = tf.nest.map_structure(host_tensor, tensors)
        num_examples = int(tf.nest.flatten(host)[0].shape[0])

        def indices(positions: tf.Tensor) -> tf.Tensor:
            return epoch_shuffled(positions, num_examples, seed)

        return cls(
            tensors=host,
            indices=indices,
            host_data=_host_stream(host, indices, transform, global_batch_size),
            transform=transform,
            global_batch_size=global_batch_size,
        )

    def __post_init__(self) -> None:
        _num_examples(self.tensors, "ResidentData")

    @property
    def num_bytes(self) -> int:
        """Bytes one replica's copy takes."""
        return _num_bytes(self.tensors)

    def replica_indices(
        self, first_step: tf.Tensor, num_steps: tf.Tensor, *, global_batch_size: int
    ) -> tf.Tensor:
        """Example indices of this replica's batches of steps [first_step, first_step + num_steps),
        shape (num_steps, per-replica batch); called inside `strategy.run`. One call a loop
        keeps the index arithmetic off the per-step path."""
        context = tf.distribute.get_replica_context()
        per_replica = global_batch_size // context.num_replicas_in_sync
        replica = tf.cast(context.replica_id_in_sync_group, tf.int64)
        steps = tf.cast(first_step, tf.int64) + tf.range(tf.cast(num_steps, tf.int64))
        positions = (steps * global_batch_size + replica * per_replica)[:, None] + tf.range(
            per_replica, dtype=tf.int64
        )
        return tf.reshape(user_code(self.indices)(tf.reshape(positions, [-1])), [-1, per_replica])

    def gather(self, replica_tensors: Any, indices: tf.Tensor) -> Any:
        """The batch of the examples at `indices`, from this replica's copy, transformed."""
        batch = tf.nest.map_structure(lambda tensor: tf.gather(tensor, indices), replica_tensors)
        return batch if self.transform is None else user_code(self.transform)(batch)

    def batch_at(self, replica_tensors: Any, step: tf.Tensor, *, global_batch_size: int) -> Any:
        """This replica's batch of global step `step`; called inside `strategy.run`."""
        return self.gather(
            replica_tensors, self.replica_indices(step, 1, global_batch_size=global_batch_size)[0]
        )


def epoch_shuffled(positions: tf.Tensor, num_examples: int, seed: int) -> tf.Tensor:
    """Example index at each stream position (int64 vector): every epoch its own
    stateless permutation, keyed by (seed, epoch), so any position is computed in O(1).

    One batch may span several epochs, so each position gets its own seed row.
    The raw op is used because tf.random.experimental.index_shuffle pads a
    batched [n, 2] seed along the wrong axis in TF 2.21 and the op rejects it.
    """
    epochs = positions // num_examples
    offsets = positions % num_examples
    seeds = tf.stack(
        [
            tf.fill(tf.shape(positions), tf.constant(seed, tf.int64)),
            epochs,
            tf.zeros_like(positions),  # A third key word, fixed: streams made before it existed stay the same.
        ],
        axis=1,
    )
    return tf.raw_ops.RandomIndexShuffle(
        index=offsets, seed=seeds, max_index=tf.constant(num_examples - 1, tf.int64), rounds=4
    )


def gather_pipeline_options() -> tf.data.Options:
    """Deterministic, and one tf.data thread with single-threaded ops.

    A gather-by-index pipeline needs little CPU a batch; with tf.data's default
    thread pools its threads contend with the training step for the cores, and
    the step loses a quarter of its speed (benchmarks/RESULTS.md).
    """
    options = tf.data.Options()
    options.deterministic = True
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    return options


def host_tensor(value: Any) -> tf.Tensor:
    """In host memory even where a GPU is the default device: tf.data reads it there."""
    with tf.device("/cpu:0"):
        return tf.convert_to_tensor(value)


def _host_stream(
    tensors: Any,
    indices: Callable[[tf.Tensor], tf.Tensor],
    transform: Callable[[Any], Any] | None,
    global_batch_size: int,
) -> Callable[[tf.distribute.InputContext, int], tf.data.Dataset]:
    """The resident stream as `fn(input_context, start_step)` of per-replica batches:
    pipeline p yields, step after step, the batches of its replicas in replica order."""

    def pipeline(input_context: tf.distribute.InputContext, start_step: int) -> tf.data.Dataset:
        replicas, pipelines = input_context.num_replicas_in_sync, input_context.num_input_pipelines
        if global_batch_size % replicas or replicas % pipelines:
            raise ValueError(
                f"global_batch_size {global_batch_size} must split evenly over {replicas} replicas "
                f"and they over {pipelines} input pipelines"
            )
        per_replica, own = global_batch_size // replicas, replicas // pipelines
        offset = input_context.input_pipeline_id * own * per_replica

        def step_indices(step: tf.Tensor) -> tf.Tensor:
            positions = step * global_batch_size + offset + tf.range(own * per_replica, dtype=tf.int64)
            return tf.reshape(indices(positions), [own, per_replica])

        def gather(batch_indices: tf.Tensor) -> Any:
            batch = tf.nest.map_structure(lambda tensor: tf.gather(tensor, batch_indices), tensors)
            return batch if transform is None else transform(batch)

        return (
            tf.data.Dataset.counter(start_step, dtype=tf.int64)
            .map(step_indices)
            .unbatch()
            .map(gather)
            .prefetch(tf.data.AUTOTUNE)
            .with_options(gather_pipeline_options())
        )

    return pipeline


def keeps_on_devices(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` runs the training loop on devices that can hold the data:
    not a parameter-server cluster (the loop runs on remote workers) nor a TPU
    (not verified here)."""
    remote = (tf.distribute.experimental.ParameterServerStrategy, tf.distribute.TPUStrategy)
    return not isinstance(strategy, remote)


@dataclass(frozen=True)
class ResidentEvalData:
    """An eval split held whole in memory, read in order at every evaluation.

    Global batch k is examples [k*B, min((k+1)*B, N)) for the global batch
    size B; replica r of R evaluates the r-th slice of B/R examples of it,
    cut at N, so in the last batch a replica may get fewer or none. Every
    example counts once: the same sums as the tf.data eval forms.

    Args:
      tensors: a nest of host tensors (or arrays), first dimension = examples:
        `(features, labels[, sample_weights])` as the eval step reads a batch.
      host_data: the same examples as an eval form the `Trainer` takes (a
        `tf.data.Dataset` of global batches or `fn(input_context)`), for
        strategies that cannot keep the tensors on their devices.
      global_batch_size: the batch the eval set is read in; it must be the
        Trainer's.
      transform: applied to each gathered per-replica batch on its device, or None.
    """

    tensors: Any
    host_data: Any
    global_batch_size: int
    transform: Callable[[Any], Any] | None = field(default=None)

    def __post_init__(self) -> None:
        _num_examples(self.tensors, "ResidentEvalData")
        if isinstance(self.global_batch_size, bool) or not isinstance(self.global_batch_size, int):
            raise ValueError(f"global_batch_size must be an int, got {self.global_batch_size!r}")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {self.global_batch_size}")

    @property
    def num_examples(self) -> int:
        return _num_examples(self.tensors, "ResidentEvalData")

    @property
    def num_batches(self) -> int:
        """Global batches in one pass, the last one partial where B does not divide N."""
        return -(-self.num_examples // self.global_batch_size)

    @property
    def num_bytes(self) -> int:
        """Bytes one replica's copy takes."""
        return _num_bytes(self.tensors)

    def replica_batch(self, replica_tensors: Any, batch_index: tf.Tensor) -> Any:
        """This replica's part of global batch `batch_index`, from its own copy, transformed;
        called inside `strategy.run`."""
        context = tf.distribute.get_replica_context()
        per_replica = self.global_batch_size // context.num_replicas_in_sync
        replica = tf.cast(context.replica_id_in_sync_group, tf.int64)
        num_examples = tf.constant(self.num_examples, tf.int64)
        start = tf.cast(batch_index, tf.int64) * self.global_batch_size + replica * per_replica
        first, end = tf.minimum(start, num_examples), tf.minimum(start + per_replica, num_examples)
        batch = tf.nest.map_structure(lambda tensor: tensor[first:end], replica_tensors)
        return batch if self.transform is None else user_code(self.transform)(batch)


def _num_examples(tensors: Any, what: str) -> int:
    """The first dimension every tensor of the nest shares (read from shapes: nothing is copied)."""
    sizes = {int(t.shape[0]) if hasattr(t, "shape") else len(t) for t in tf.nest.flatten(tensors)}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"{what} tensors must share one non-zero first dimension (examples), got {sorted(sizes)}"
        )
    return sizes.pop()


def _num_bytes(tensors: Any) -> int:
    return sum(int(tf.size(t)) * tf.as_dtype(t.dtype).size for t in tf.nest.flatten(tensors))


def place_on_replicas(strategy: tf.distribute.Strategy, data: ResidentData | ResidentEvalData) -> Any:
    """One copy of the tensors on each local replica's device (a per-replica value)."""
    host = tf.nest.map_structure(tf.convert_to_tensor, data.tensors)
    return strategy.experimental_distribute_values_from_function(
        lambda _: tf.nest.map_structure(tf.identity, host)
    )


def _as_numpy(data: Any) -> Any:
    """pandas DataFrames and Series as numpy arrays (Keras's pandas adapter does the same); a
    list of arrays as a tuple (tf.data would stack a list into one tensor)."""
    if hasattr(data, "to_numpy") and not isinstance(data, np.ndarray):
        return data.to_numpy()
    if isinstance(data, dict):
        return {key: _as_numpy(value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return tuple(_as_numpy(value) for value in data)
    return data


def _example_arrays(data: Any, argument: str) -> tuple | None:
    """`data` as `(features, labels[, sample_weight])` numpy arrays (pandas objects converted, as
    Keras's pandas adapter does), or None where it is not examples as arrays (a dataset, a function)."""
    if not isinstance(data, (tuple, list, dict)):
        return None
    arrays = _as_numpy(data)
    leaves = tf.nest.flatten(arrays)
    if not leaves or not all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return None
    if not isinstance(arrays, tuple) or len(arrays) not in (2, 3):
        raise UserError(
            f"{argument} as arrays is (features, labels) or (features, labels, sample_weight), got "
            f"{type(data).__name__} of {len(arrays)}"
        )
    return arrays


def arrays_as_train_data(data: Any, global_batch_size: int, seed: int = 0) -> Any:
    """`(features, labels[, sample_weight])` arrays (numpy, pandas; features may be a dict or
    tuple of arrays) as `ResidentData.shuffled`: kept on the devices, a new seeded order every
    epoch (Keras `fit` shuffles too), resumable exactly. Anything else is returned as it is."""
    arrays = _example_arrays(data, "train_data")
    if arrays is None:
        return data
    return ResidentData.shuffled(arrays, seed=seed, global_batch_size=global_batch_size)


def arrays_as_eval_data(data: Any, global_batch_size: int) -> Any:
    """Eval arrays (as `arrays_as_train_data` takes them) as `ResidentEvalData`, read in order."""
    arrays = _example_arrays(data, "eval_data")
    if arrays is None:
        return data
    host = tf.data.Dataset.from_tensor_slices(arrays).batch(global_batch_size)
    return ResidentEvalData(tensors=arrays, host_data=host, global_batch_size=global_batch_size)


def host_form_of(data: Any) -> Any:
    """`ResidentEvalData`'s tf.data form (`host_data`), for an evaluation that reads an iterator."""
    return as_eval_form(data.host_data) if isinstance(data, ResidentEvalData) else data
