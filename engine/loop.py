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
EvalLoop = Callable[[tf.distribute.DistributedIterator, tf.Tensor], tf.Tensor]


def make_train_loop(
    strategy: tf.distribute.Strategy,
    replica_step: ReplicaStep,
    global_step: tf.Variable | None,
) -> TrainLoop:
    """Returns `loop(iterator, num_steps) -> {name: mean over the loop}`.

    Each step's outputs are averaged over replicas, then over the steps of
    the loop whose outputs are all finite. Two more entries say whether any
    were not: `nonfinite_steps` (how many) and `first_nonfinite_index` (the
    0-based index in this loop of the first, or -1), so the host can stop
    or count without a per-step sync. The first step is peeled off the
    `tf.range` loop so that the accumulators take the structure the step
    returns.

    With `global_step=None` the loop does not count steps: the
    parameter-server coordinator counts the steps it scheduled, because a
    closure retried after a worker failure may have run some steps twice.
    """

    def one_step(iterator) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        outputs = strategy.run(replica_step, args=(next(iterator),))
        if global_step is not None:
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
        outputs, finite = one_step(iterator)
        zeros = {name: tf.zeros_like(value) for name, value in outputs.items()}
        state = accumulate(zeros, tf.constant(0.0), tf.constant(0), tf.constant(-1),
                           tf.constant(0), outputs, finite)
        for index in tf.range(1, num_steps):
            outputs, finite = one_step(iterator)
            state = accumulate(*state, index, outputs, finite)
        totals, count, bad, first_bad = state
        means = {name: total / tf.maximum(count, 1.0) for name, total in totals.items()}
        means["nonfinite_steps"] = bad
        means["first_nonfinite_index"] = first_bad
        return means

    return train_loop


def make_eval_loop(
    strategy: tf.distribute.Strategy, replica_step: Callable[[Batch], None]
) -> EvalLoop:
    """Returns `loop(iterator, max_batches) -> exhausted`: the step over at
    most `max_batches` more batches of the iterator, and whether it ran out.

    Evaluating in such bounded calls lets the host check for a stop request
    between them: one compiled call over the whole eval set keeps a SIGTERM
    waiting as long as the set is large. `get_next_as_optional` keeps the
    exact-evaluation rules of a `for batch in dataset` loop (partial last
    batch, replicas with an empty batch): every example counts once.
    """

    @tf.function
    def eval_loop(iterator, max_batches: tf.Tensor) -> tf.Tensor:
        exhausted = tf.constant(False)
        for _ in tf.range(max_batches):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                exhausted = tf.constant(True)
                break
            strategy.run(replica_step, args=(optional.get_value(),))
        return exhausted

    return eval_loop
