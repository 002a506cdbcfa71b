"""The compiled functions: the only place that calls `strategy.run`.

The train function runs `num_steps` steps in a `tf.range` loop inside one
`tf.function`. `num_steps` is a tensor, so loops of different lengths (the
last one of a run, one cut short by an evaluation) reuse one trace, and the
per-call Python overhead is paid once per loop instead of once per step.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from engine.steps import Batch, ReplicaStep

TrainLoop = Callable[[tf.distribute.DistributedIterator, tf.Tensor], dict]
EvalLoop = Callable[[tf.distribute.DistributedDataset], None]


def make_train_loop(
    strategy: tf.distribute.Strategy,
    replica_step: ReplicaStep,
    global_step: tf.Variable | None,
) -> TrainLoop:
    """Returns `loop(iterator, num_steps) -> {name: mean over the loop}`.

    Each step's outputs are averaged over replicas, then over the steps of
    the loop. The first step is peeled off the `tf.range` loop so that the
    accumulators take the structure the step function returns.

    With `global_step=None` the loop does not count steps: the
    parameter-server coordinator counts the steps it scheduled, because a
    closure retried after a worker failure may have run some steps twice.
    """

    def one_step(iterator) -> dict[str, tf.Tensor]:
        outputs = strategy.run(replica_step, args=(next(iterator),))
        if global_step is not None:
            global_step.assign_add(1)
        return {
            name: tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None), tf.float32)
            for name, value in (outputs or {}).items()
        }

    @tf.function
    def train_loop(iterator, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        totals = one_step(iterator)
        for _ in tf.range(num_steps - 1):
            outputs = one_step(iterator)
            totals = {name: totals[name] + outputs[name] for name in totals}
        count = tf.cast(num_steps, tf.float32)
        return {name: total / count for name, total in totals.items()}

    return train_loop


def make_eval_loop(
    strategy: tf.distribute.Strategy, replica_step: Callable[[Batch], None]
) -> EvalLoop:
    """Returns `loop(distributed_dataset)` that runs the step over all of it."""

    @tf.function
    def eval_loop(dataset) -> None:
        for batch in dataset:
            strategy.run(replica_step, args=(batch,))

    return eval_loop
