"""Training data kept whole on every replica's device, batches gathered inside the compiled loop.

For a data set that fits in device memory, the tf.data iterator is the
largest cost the engine adds to a bare compiled loop on a small model: each
step pulls a batch through the distributed iterator, which splits it and
places each replica's part (measured on the cnn, 2 replicas on 2 CPU cores:
~6 % of the step). With `ResidentData` the arrays are copied to each
replica's device once, and every step computes its batch from the step
number inside the compiled loop: the same stateless `(seed, step)` stream
the `input` package's tf.data pipelines yield, so a resumed run gets exactly
the batches it would have had, with no iterator at all.

Strategies that do not run the loop on the replicas' own devices
(parameter-server training, TPU) train from `host_data`, the same stream
through tf.data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf


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
    """

    tensors: Any
    indices: Callable[[tf.Tensor], tf.Tensor]
    host_data: Any
    transform: Callable[[Any], Any] | None = field(default=None)

    def __post_init__(self) -> None:
        sizes = {int(tf.convert_to_tensor(t).shape[0]) for t in tf.nest.flatten(self.tensors)}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                f"ResidentData tensors must share one non-zero first dimension (examples), got {sorted(sizes)}"
            )

    @property
    def num_bytes(self) -> int:
        """Bytes one replica's copy takes."""
        return sum(int(tf.size(t)) * tf.as_dtype(t.dtype).size for t in tf.nest.flatten(self.tensors))

    def batch_at(self, replica_tensors: Any, step: tf.Tensor, *, global_batch_size: int) -> Any:
        """This replica's batch of global step `step`; called inside `strategy.run`."""
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        per_replica = global_batch_size // replicas
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
        first = tf.cast(step, tf.int64) * global_batch_size + replica * per_replica
        indices = self.indices(first + tf.range(per_replica, dtype=tf.int64))
        batch = tf.nest.map_structure(lambda tensor: tf.gather(tensor, indices), replica_tensors)
        return batch if self.transform is None else self.transform(batch)


def keeps_on_devices(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` runs the training loop on devices that can hold the data:
    not a parameter-server cluster (the loop runs on remote workers) nor a TPU
    (not verified here)."""
    remote = (tf.distribute.experimental.ParameterServerStrategy, tf.distribute.TPUStrategy)
    return not isinstance(strategy, remote)


def place_on_replicas(strategy: tf.distribute.Strategy, data: ResidentData) -> Any:
    """One copy of the tensors on each local replica's device (a per-replica value)."""
    host = tf.nest.map_structure(tf.convert_to_tensor, data.tensors)
    return strategy.experimental_distribute_values_from_function(
        lambda _: tf.nest.map_structure(tf.identity, host)
    )
