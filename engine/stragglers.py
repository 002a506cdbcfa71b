"""Which worker of a synchronous run is slow: each worker's compute and input wait per step, compared.

A synchronous step runs at the slowest worker's speed, and every worker's wall time per step
is the same: each waits in the gradient all-reduce for the last to arrive. What differs is the
time a worker spends computing before it joins, and waiting for its next batch. The standard
step (`engine.loop.steps`) times the first with `tf.timestamp` in the graph, from its batch to
its gradients, into a `ComputeClock`; the compiled loop (`engine.loop.compiled`) times its
iterator's get_next into an `InputClock`: variables local to each worker, never all-reduced,
never checkpointed.
Between loops each worker reads its own clock (no collective) and the stop agreement's one
all-reduce (`engine.stopping`) carries every worker's seconds per step to every worker, so the
report adds no collective round. `StragglerWatch` then compares each worker's step time
(compute plus input wait) with the median of the others': one slower by `margin` for `loops`
loops in a row is named once, in one line (`worker:1 (10.0.0.2) 1.8x the median step time of
the others for 5 loops (...: compute 20.1 ms, input wait 0.2 ms)`), and again only after it
recovered and fell behind anew.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from engine.compat import op_determinism_enabled
from engine.logger import logger
from engine.options import ThroughputOptions
from engine.stopping import StopAgreement

# TensorBoard, train split: a chart per worker and figure (e.g. compute_seconds_per_step/worker_1).
FIGURES = ("compute_seconds_per_step", "input_wait_seconds_per_step")


class _Seconds:
    """A float64 count of seconds, one copy per replica of this worker (ON_READ: never
    all-reduced, not checkpointed), read on the host as the mean of this worker's copies."""

    def __init__(self, strategy: tf.distribute.Strategy, name: str, aggregation: tf.VariableAggregation):
        self._strategy = strategy
        with strategy.scope():
            self.variable = tf.Variable(
                tf.constant(0.0, tf.float64),
                trainable=False,
                name=name,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=aggregation,
            )
        self._last_total = 0.0

    def per_step(self, steps: int) -> float:
        """Seconds per step since the last call, over `steps` steps; no collective."""
        local = self._strategy.experimental_local_results(self.variable)
        total = sum(float(value.numpy()) for value in local) / max(1, len(local))
        elapsed, self._last_total = total - self._last_total, total
        return elapsed / max(1, steps)


class ComputeClock:
    """Seconds this process's replicas spent computing their steps' gradients.

    Create it in the strategy's scope; `start`/`stop` go in the replica step; `seconds_per_step`
    reads this worker's own replicas on the host."""

    def __init__(self, strategy: tf.distribute.Strategy):
        # SUM: each replica adds to its own copy in the replica step.
        self._seconds = _Seconds(strategy, "compute_seconds", tf.VariableAggregation.SUM)

    @staticmethod
    def start(after: object) -> tf.Tensor:
        """The step's start: a timestamp taken once `after` (the batch) is there."""
        with tf.control_dependencies(tf.nest.flatten(after)):
            return tf.timestamp()

    def stop(self, started: tf.Tensor, after: object) -> None:
        """Adds the time from `started` until `after` (the gradients) are computed to this replica's clock."""
        with tf.control_dependencies([t for t in tf.nest.flatten(after) if t is not None]):
            self._seconds.variable.assign_add(tf.timestamp() - started)

    def seconds_per_step(self, steps: int) -> float:
        """This worker's compute seconds per step since the last call (the mean of its replicas)."""
        return self._seconds.per_step(steps)


class InputClock:
    """Seconds this worker's compiled loop waited for its next batch (the iterator's get_next in the
    loop, between steps). `start`/`stop` go around the loop's get_next, in cross-replica context;
    `seconds_per_step` reads this worker's own copies."""

    def __init__(self, strategy: tf.distribute.Strategy):
        # ONLY_FIRST_REPLICA: assignable in cross-replica context, every copy the same count.
        self._seconds = _Seconds(strategy, "input_wait_seconds", tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @staticmethod
    def start() -> tf.Tensor:
        return tf.timestamp()

    def stop(self, started: tf.Tensor, batch: tf.experimental.Optional) -> None:
        """Adds the time since `started` until `batch` (an optional) is there."""
        with tf.control_dependencies([batch.has_value()]):
            self._seconds.variable.assign_add(tf.timestamp() - started)

    def seconds_per_step(self, steps: int) -> float:
        """This worker's input wait per step since the last call."""
        return self._seconds.per_step(steps)


@dataclasses.dataclass
class StragglerWatch:
    """Names a worker whose step time (its compute plus its wait for input) is `margin` times the
    median of the others' for `loops` loops in a row (once, until it recovers)."""

    tasks: Sequence[tuple[str, str]]  # (name, host) of each worker, in the agreement's order.
    margin: float = 1.5
    loops: int = 5

    def __post_init__(self) -> None:
        self._behind = [0] * len(self.tasks)  # Loops in a row each task was behind.
        self.last: dict[str, dict[str, float]] = {}  # Each figure of the last loop: {figure: {task: seconds}}.

    def observe(self, compute: Sequence[float], input_wait: Sequence[float] | None = None) -> list[str]:
        """The loop's seconds per step of each task; returns the lines to log (a task just found slow)."""
        waits = list(input_wait) if input_wait is not None else [0.0] * len(compute)
        names = [name for name, _ in self.tasks]
        self.last = {
            "compute_seconds_per_step": dict(zip(names, compute, strict=True)),
            "input_wait_seconds_per_step": dict(zip(names, waits, strict=True)),
        }
        steps = [c + w for c, w in zip(compute, waits, strict=True)]
        lines = []
        for index, ((name, host), seconds) in enumerate(zip(self.tasks, steps, strict=True)):
            others = [s for i, s in enumerate(steps) if i != index and s > 0]
            median = statistics.median(others) if others else 0.0
            ratio = seconds / median if median > 0 else 0.0
            self._behind[index] = self._behind[index] + 1 if ratio >= self.margin else 0
            if self._behind[index] == self.loops:
                lines.append(
                    f"{name} ({host}) {ratio:.1f}x the median step time of the others for {self.loops} loops "
                    f"({seconds * 1000:.1f} ms against {median * 1000:.1f} ms: compute "
                    f"{compute[index] * 1000:.1f} ms, input wait {waits[index] * 1000:.1f} ms)"
                )
        return lines


def worker_tasks(strategy: tf.distribute.Strategy) -> list[tuple[str, str]]:
    """(name, host) of every worker of a MultiWorkerMirroredStrategy, in a fixed order every
    worker agrees on (the chief first, then the workers by index); [] where there is no cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return []
    spec = resolver.cluster_spec().as_dict()
    tasks = []
    for job in ("chief", "worker"):
        hosts = spec.get(job, [])
        addresses = hosts.values() if isinstance(hosts, dict) else hosts
        tasks += [(f"{job}:{index}", address.rsplit(":", 1)[0]) for index, address in enumerate(addresses)]
    return tasks


def own_index(strategy: tf.distribute.Strategy, tasks: Sequence[tuple[str, str]]) -> int:
    """This worker's index in `tasks`."""
    resolver = strategy.cluster_resolver
    return [name for name, _ in tasks].index(f"{resolver.task_type}:{resolver.task_id}")


class StragglerReport:
    """The Trainer's part: this worker's clocks, the figures it sends with the stop agreement, and
    what the agreement brought back (logged, written to TensorBoard, kept for metrics.json)."""

    def __init__(
        self, strategy: tf.distribute.Strategy, options: ThroughputOptions, tasks: list[tuple[str, str]]
    ):
        self.clock = ComputeClock(strategy)
        self.input_clock = InputClock(strategy)
        self.watch = StragglerWatch(tasks, margin=options.straggler_margin, loops=options.straggler_loops)
        self._own = own_index(strategy, tasks)
        self._own_figures = (0.0, 0.0)  # This worker's (compute, input wait) per step in the last loop.

    @classmethod
    def create(
        cls, strategy: tf.distribute.Strategy, options: ThroughputOptions, agreement: StopAgreement
    ) -> StragglerReport | None:
        """A report where workers agree between loops (multi_worker_mirrored, 2+ workers),
        `straggler_margin` is set and op determinism is not enabled; else None."""
        if agreement.all_reduce is None or not options.straggler_margin:
            return None
        if op_determinism_enabled():  # TensorFlow refuses tf.timestamp there.
            logger.info("no straggler report: op determinism (--deterministic) forbids the timestamps it takes")
            return None
        tasks = worker_tasks(strategy)
        return cls(strategy, options, tasks) if len(tasks) > 1 else None

    def loop_done(self, steps: int) -> None:
        if steps > 0:
            self._own_figures = (self.clock.seconds_per_step(steps), self.input_clock.seconds_per_step(steps))

    def figures(self) -> list[float]:
        """What this worker adds to the agreement: its compute and input wait per step, in its own
        slots of each (every worker's compute, then every worker's input wait)."""
        workers = len(self.watch.tasks)
        slots = [0.0] * (2 * workers)
        slots[self._own], slots[workers + self._own] = self._own_figures
        return slots

    def agreed(self, figures: Sequence[float], step: int, summaries: Any) -> None:
        """Every worker's figures as the agreement summed them: compared, logged, written."""
        workers = len(self.watch.tasks)
        compute, waits = list(figures[:workers]), list(figures[workers:])
        if len(waits) != workers or not all(seconds > 0 for seconds in compute):
            return  # Before the first loop (or a worker without a figure yet).
        for line in self.watch.observe(compute, waits):
            logger.warning("%s", line)
        scalars = {
            f"{figure}/{name.replace(':', '_')}": seconds
            for figure, by_task in self.watch.last.items()
            for name, seconds in by_task.items()
        }
        summaries.write("train", step, scalars)
