"""engine.stragglers: which worker of a synchronous run computes slowly. The watch's decision
from figures alone; the compute clock in a compiled step on this process's replicas. The
report on a real cluster with a worker slowed on purpose: tests/cluster/test_stragglers.py."""

import time

import pytest
import tensorflow as tf

from engine.stragglers import ComputeClock, StragglerWatch

TASKS = [("worker:0", "10.0.0.1"), ("worker:1", "10.0.0.2"), ("worker:2", "10.0.0.3")]


def test_a_worker_behind_the_others_median_for_the_set_loops_is_named_once_and_again_after_recovering():
    watch = StragglerWatch(TASKS, margin=1.5, loops=3)
    even, slow = [0.010, 0.011, 0.010], [0.010, 0.010, 0.018]  # worker:2 1.8x the others' median
    assert [watch.observe(even) for _ in range(4)] == [[]] * 4
    assert watch.observe(slow) == [] and watch.observe(slow) == []
    assert watch.observe(slow) == [
        "worker:2 (10.0.0.3) 1.8x the median compute time per step of the others for 3 loops "
        "(18.0 ms against 10.0 ms)"
    ]
    assert watch.observe(slow) == [] and watch.observe(slow) == []  # Named once while it stays behind.
    assert watch.last == {"worker:0": 0.010, "worker:1": 0.010, "worker:2": 0.018}
    watch.observe(even)  # It caught up; behind again for 3 loops: named again.
    assert [len(watch.observe(slow)) for _ in range(3)] == [0, 0, 1]


def test_a_loop_below_the_margin_resets_the_count_and_two_workers_compare_with_each_other():
    watch = StragglerWatch(TASKS[:2], margin=1.5, loops=2)
    assert watch.observe([0.010, 0.016]) == []
    assert watch.observe([0.010, 0.014]) == []  # 1.4x: not behind, the count starts again.
    assert watch.observe([0.010, 0.016]) == []
    assert watch.observe([0.010, 0.020]) == [
        "worker:1 (10.0.0.2) 2.0x the median compute time per step of the others for 2 loops "
        "(20.0 ms against 10.0 ms)"
    ]  # With two workers "the others" is the other one; the fast one is never named.


def test_the_compute_clock_adds_each_replicas_time_from_its_batch_to_its_gradients_and_nothing_after(mirrored):
    clock = ComputeClock(mirrored)

    def matmuls(product, batch, count):
        for _ in range(count):
            product = tf.linalg.matmul(product, batch) / 256.0
        return product

    @tf.function
    def loop():
        def step():
            batch = tf.random.normal([256, 256])
            started = clock.start(batch)
            gradients = matmuls(batch, batch, 5)  # Timed: the step until its gradients.
            clock.stop(started, gradients)
            return matmuls(gradients, batch, 50)  # Not timed: what follows (the all-reduce's wait).

        total = tf.constant(0.0)
        for _ in tf.range(3):
            total += tf.reduce_sum(mirrored.experimental_local_results(mirrored.run(step))[0])
        return total

    loop()  # Traced.
    clock.seconds_per_step(3)
    began = time.perf_counter()
    loop()
    wall_per_step = (time.perf_counter() - began) / 3
    timed = clock.seconds_per_step(3)
    assert 0 < timed < 0.5 * wall_per_step  # 5 of the step's 55 products, on each replica.
    assert clock.seconds_per_step(3) == 0.0  # Since the last reading: nothing ran.


def test_the_options_refuse_a_margin_that_names_everyone():
    from engine.errors import UserError
    from engine.options import ThroughputOptions

    with pytest.raises(UserError, match=r"`straggler_margin=1.0` must be above 1, e.g. 1.5 \(0: no report\)"):
        ThroughputOptions(straggler_margin=1.0)
    with pytest.raises(UserError, match=r"`straggler_loops=0` must be at least 1"):
        ThroughputOptions(straggler_loops=0)
    assert ThroughputOptions(straggler_margin=0).straggler_margin == 0  # Off.
