"""engine.stragglers: which worker of a synchronous run computes slowly. The watch's decision
from figures alone; the compute clock in a compiled step on this process's replicas. The
report on a real cluster with a worker slowed on purpose: tests/cluster/test_slow_worker.py."""

import time

import pytest
import tensorflow as tf

from engine.stragglers import ComputeClock, InputClock, StragglerWatch

TASKS = [("worker:0", "10.0.0.1"), ("worker:1", "10.0.0.2"), ("worker:2", "10.0.0.3")]


def test_a_worker_behind_the_others_median_for_the_set_loops_is_named_once_and_again_after_recovering():
    watch = StragglerWatch(TASKS, margin=1.5, loops=3)
    even, slow = [0.010, 0.011, 0.010], [0.010, 0.010, 0.018]  # worker:2 1.8x the others' median
    assert [watch.observe(even) for _ in range(4)] == [[]] * 4
    assert watch.observe(slow) == [] and watch.observe(slow) == []
    assert watch.observe(slow) == [
        "worker:2 (10.0.0.3) 1.8x the median step time of the others for 3 loops "
        "(18.0 ms against 10.0 ms: compute 18.0 ms, input wait 0.0 ms)"
    ]
    assert watch.observe(slow) == [] and watch.observe(slow) == []  # Named once while it stays behind.
    assert watch.last["compute_seconds_per_step"] == {"worker:0": 0.010, "worker:1": 0.010, "worker:2": 0.018}
    watch.observe(even)  # It caught up; behind again for 3 loops: named again.
    assert [len(watch.observe(slow)) for _ in range(3)] == [0, 0, 1]


def test_a_worker_that_waits_for_its_input_is_named_by_its_step_time_compute_plus_wait():
    watch = StragglerWatch(TASKS, margin=1.5, loops=1)
    compute, waits = [0.010, 0.010, 0.010], [0.001, 0.001, 0.019]  # worker:2 computes evenly, waits long
    assert watch.observe(compute, waits) == [
        "worker:2 (10.0.0.3) 2.6x the median step time of the others for 1 loops "
        "(29.0 ms against 11.0 ms: compute 10.0 ms, input wait 19.0 ms)"
    ]
    assert watch.last["input_wait_seconds_per_step"] == {"worker:0": 0.001, "worker:1": 0.001, "worker:2": 0.019}


def test_a_loop_below_the_margin_resets_the_count_and_two_workers_compare_with_each_other():
    watch = StragglerWatch(TASKS[:2], margin=1.5, loops=2)
    assert watch.observe([0.010, 0.016]) == []
    assert watch.observe([0.010, 0.014]) == []  # 1.4x: not behind, the count starts again.
    assert watch.observe([0.010, 0.016]) == []
    assert watch.observe([0.010, 0.020]) == [
        "worker:1 (10.0.0.2) 2.0x the median step time of the others for 2 loops "
        "(20.0 ms against 10.0 ms: compute 20.0 ms, input wait 0.0 ms)"
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


def test_the_input_clock_adds_the_waits_of_a_loops_get_next_on_this_worker(mirrored):
    clock = InputClock(mirrored)

    def slow(value):  # A pipeline that takes 20 ms an element.
        time.sleep(0.02)
        return value

    data = tf.data.Dataset.range(100).map(lambda x: tf.py_function(slow, [x], tf.int64))
    iterator = iter(mirrored.experimental_distribute_dataset(data.batch(2)))

    @tf.function
    def loop():
        for _ in tf.range(5):
            started = clock.start()
            batch = iterator.get_next_as_optional()
            clock.stop(started, batch)

    loop()
    waited = clock.seconds_per_step(5)
    assert 0.02 <= waited < 1.0  # Two 20 ms elements a batch (less what tf.data prefetched).
    assert clock.seconds_per_step(5) == 0.0


def test_no_report_under_op_determinism_which_refuses_timestamps():
    """tf.timestamp fails under op determinism ("Timestamp cannot be called when determinism is
    enabled"): --deterministic multi-worker runs train without the report (tests/cluster/test_launch.py
    runs them)."""
    from unittest import mock

    from engine.options import ThroughputOptions
    from engine.stragglers import StragglerReport

    class Agreeing:
        all_reduce = object()  # As with several workers.

    with mock.patch("engine.stragglers.op_determinism_enabled", return_value=True):
        assert StragglerReport.create(None, ThroughputOptions(), Agreeing()) is None
