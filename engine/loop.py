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
    *,
    first_step: ReplicaStep | None = None,
) -> TrainLoop:
    """Returns `loop(iterator, num_steps) -> {name: mean over the loop}`.

    Each step's outputs are averaged over replicas, then over the steps of
    the loop whose outputs are all finite. More entries say whether any
    were not: `nonfinite_steps` (how many) and `first_nonfinite_index` (the
    0-based index in this loop of the first, or -1), so the host can stop
    or count without a per-step sync; and `steps_run`, fewer than
    `num_steps` when the data ran out during the loop. The first step is
    peeled off the `tf.range` loop so that the accumulators take the
    structure the step returns; `first_step` (default `replica_step`) runs
    it, e.g. with a check of the batch. When there is no batch at all for
    the first step the call raises `tf.errors.OutOfRangeError`, having
    applied nothing.

    With `global_step=None` the loop does not count steps: the
    parameter-server coordinator counts the steps it scheduled, because a
    closure retried after a worker failure may have run some steps twice.
    """

    def one_step(step_fn: ReplicaStep, batch) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        outputs = strategy.run(step_fn, args=(batch,))
        if global_step is not None:
            # Counted only once the batch exists: a step whose data ran out applied nothing.
            local = tf.nest.map_structure(strategy.experimental_local_results, batch)
            with tf.control_dependencies(tf.nest.flatten(local, expand_composites=True)):
                global_step.assign_add(1)
        reduced = {
            name: tf.cast(strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None), tf.float32)
            for name, value in (outputs or {}).items()
        }
        finite = tf.reduce_all([tf.math.is_finite(v) for v in reduced.values()] or [True])
        return reduced, finite

    def accumulate(totals, count, bad, first_bad, index, outputs, finite):
        totals = {n: totals[n] + tf.where(finite, outputs[n], 0.0) for n in totals}
        first_bad = tf.where(tf.logical_or(finite, first_bad >= 0), first_bad, index)
        return totals, count + tf.cast(finite, tf.float32), bad + 1 - tf.cast(finite, tf.int32), first_bad

    @tf.function
    def train_loop(iterator, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        outputs, finite = one_step(first_step or replica_step, next(iterator))
        zeros = {name: tf.zeros_like(value) for name, value in outputs.items()}
        state = accumulate(zeros, tf.constant(0.0), tf.constant(0), tf.constant(-1),
                           tf.constant(0), outputs, finite)
        steps_run = tf.constant(1)
        for index in tf.range(1, num_steps):
            # A finite dataset ends the loop early instead of failing it mid-way.
            next_batch = iterator.get_next_as_optional()
            if not next_batch.has_value():
                break
            outputs, finite = one_step(replica_step, next_batch.get_value())
            state = accumulate(*state, index, outputs, finite)
            steps_run += 1
        totals, count, bad, first_bad = state
        means = {name: total / tf.maximum(count, 1.0) for name, total in totals.items()}
        means["nonfinite_steps"] = bad
        means["first_nonfinite_index"] = first_bad
        means["steps_run"] = steps_run
        return means

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
