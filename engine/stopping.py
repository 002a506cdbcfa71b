"""The stop agreement: every worker of a multi-worker run stops after the same loop.

A signal reaches one process, but multi-worker training only ends cleanly if all workers
stop at the same step (otherwise the others wait in their next all-reduce). So with
several workers a stop request is all-reduced once per loop (`make_stop_agreement`), and
a worker that learns of a peer's request takes it as its own. The Trainer holds the
request and asks for the agreement between loops. The same all-reduce carries each
worker's figures of the last loop (its compute and input wait per step: `engine.stragglers`), so
that reporting them costs no collective of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from engine.compat import num_workers


def make_stop_agreement(strategy: tf.distribute.Strategy):
    """A compiled sum of a vector over all workers (its first entry the stop flag, the rest
    figures each worker fills its own slots of) for multi-worker mirrored training, divided by
    the replicas each worker has; None where one process decides alone."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    workers = num_workers(strategy)
    if workers < 2:
        return None
    replicas_per_worker = strategy.num_replicas_in_sync // workers

    @tf.function
    def sum_over_workers(values: tf.Tensor) -> tf.Tensor:
        per_replica = strategy.run(tf.identity, args=(values,))
        summed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return summed / replicas_per_worker

    return sum_over_workers


class StopAgreement:
    """A worker's stop request and, with several workers, the agreement on it.

    `request()` may come from a signal's watcher thread at any time; `should_stop()`,
    called between loops, decides. With an `all_reduce` (several workers) only the agreed
    value decides: a request that lands after the all-reduce waits for the next loop's
    agreement, or this worker would stop a loop before its peers, who then lose it
    mid-collective.
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        self.all_reduce = make_stop_agreement(strategy)  # None: this process decides alone.
        self.requested = False  # Set by request() (a signal, a peer worker).
        self._agreed = False  # Multi-worker: every worker agreed to stop.
        self.figures: list[float] = []  # The figures of the last agreement, summed over the workers.

    def request(self) -> None:
        self.requested = True

    @property
    def agreed(self) -> bool:
        """Whether a stop was agreed by every worker (one process: whether one was requested)."""
        return self.requested if self.all_reduce is None else self._agreed

    def clear(self) -> None:
        self.requested = self._agreed = False

    def should_stop(self, figures: Sequence[float] = ()) -> bool:
        """Whether to stop before the next loop, as every worker decides it. With several
        workers, `figures` (each worker the same length, zero but in its own slots) travel
        with the flag: `self.figures` holds their sum over the workers."""
        if self.all_reduce is None:
            return self.requested
        values = tf.constant([1.0 if self.requested else 0.0, *figures], tf.float64)
        summed = self.all_reduce(values).numpy()
        self.figures = [float(value) for value in summed[1:]]
        agreed = float(summed[0]) > 0
        if agreed:
            self.requested = self._agreed = True
        return agreed
