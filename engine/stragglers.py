"""Which worker of a synchronous run is slow: each worker's compute time per step, compared.

A synchronous step runs at the slowest worker's speed, and every worker's wall time per step
is the same: each waits in the gradient all-reduce for the last to arrive. What differs is the
time a worker spends computing before it joins. The standard step (`engine.loop.steps`) times
that with `tf.timestamp` in the graph, from the step's start to its gradients, into a
`ComputeClock`: a variable local to each replica, never all-reduced, never checkpointed.
Between loops each worker reads its own clock (no collective) and the stop agreement's one
all-reduce (`engine.stopping`) carries every worker's seconds per step to every worker, so the
report adds no collective round. `StragglerWatch` then compares each worker with the median of
the others: one slower by `margin` for `loops` loops in a row is named once, in one line
(`worker:1 (10.0.0.2) 1.8x the median compute time per step of the others for 5 loops`), and
again only after it recovered and fell behind anew.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from engine.logger import logger
from engine.options import ThroughputOptions
from engine.stopping import StopAgreement

SCALAR_PREFIX = "compute_seconds_per_step/"  # TensorBoard, train split: one chart per worker (.../worker_1).


class ComputeClock:
    """Seconds this process's replicas spent computing their steps' gradients, summed (float64).

    Create it in the strategy's scope; `start`/`stop` go in the replica step; `seconds_per_step`
    reads this worker's own replicas on the host."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self._strategy = strategy
        with strategy.scope():
            self._seconds = tf.Variable(
                tf.constant(0.0, tf.float64),
                trainable=False,
                name="compute_seconds",
                synchronization=tf.VariableSynchronization.ON_READ,  # One per replica, read locally.
                aggregation=tf.VariableAggregation.SUM,
            )
        self._last_total = 0.0

    @staticmethod
    def start(after: object) -> tf.Tensor:
        """The step's start: a timestamp taken once `after` (the batch) is there."""
        with tf.control_dependencies(tf.nest.flatten(after)):
            return tf.timestamp()

    def stop(self, started: tf.Tensor, after: object) -> None:
        """Adds the time from `started` until `after` (the gradients) are computed to this replica's clock."""
        with tf.control_dependencies([t for t in tf.nest.flatten(after) if t is not None]):
            self._seconds.assign_add(tf.timestamp() - started)

    def seconds_per_step(self, steps: int) -> float:
        """This worker's compute seconds per step since the last call, over `steps` steps (the mean
        of its replicas); read from its own replicas, no collective."""
        local = self._strategy.experimental_local_results(self._seconds)
        total = sum(float(value.numpy()) for value in local) / max(1, len(local))
        elapsed, self._last_total = total - self._last_total, total
        return elapsed / max(1, steps)


@dataclasses.dataclass
class StragglerWatch:
    """Names a worker that computes `margin` times slower than the median of the others for
    `loops` loops in a row (once, until it recovers)."""

    tasks: Sequence[tuple[str, str]]  # (name, host) of each worker, in the agreement's order.
    margin: float = 1.5
    loops: int = 5

    def __post_init__(self) -> None:
        self._behind = [0] * len(self.tasks)  # Loops in a row each task was behind.
        self.last: dict[str, float] = {}  # Each task's seconds per step in the last loop.

    def observe(self, seconds_per_step: Sequence[float]) -> list[str]:
        """The loop's figures, one per task; returns the lines to log (a task just found slow)."""
        self.last = {name: seconds for (name, _), seconds in zip(self.tasks, seconds_per_step, strict=True)}
        lines = []
        for index, ((name, host), seconds) in enumerate(zip(self.tasks, seconds_per_step, strict=True)):
            others = [s for i, s in enumerate(seconds_per_step) if i != index and s > 0]
            median = statistics.median(others) if others else 0.0
            ratio = seconds / median if median > 0 else 0.0
            self._behind[index] = self._behind[index] + 1 if ratio >= self.margin else 0
            if self._behind[index] == self.loops:
                lines.append(
                    f"{name} ({host}) {ratio:.1f}x the median compute time per step of the others for "
                    f"{self.loops} loops ({seconds * 1000:.1f} ms against {median * 1000:.1f} ms)"
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
    """The Trainer's part: this worker's clock, the figures it sends with the stop agreement, and
    what the agreement brought back (logged, written to TensorBoard, kept for metrics.json)."""

    def __init__(
        self, strategy: tf.distribute.Strategy, options: ThroughputOptions, tasks: list[tuple[str, str]]
    ):
        self.clock = ComputeClock(strategy)
        self.watch = StragglerWatch(tasks, margin=options.straggler_margin, loops=options.straggler_loops)
        self._own = own_index(strategy, tasks)
        self._seconds_per_step = 0.0  # This worker's, in the last loop; 0: none yet.

    @classmethod
    def create(
        cls, strategy: tf.distribute.Strategy, options: ThroughputOptions, agreement: StopAgreement
    ) -> StragglerReport | None:
        """A report where workers agree between loops (multi_worker_mirrored, 2+ workers) and
        `straggler_margin` is set; else None."""
        if agreement.all_reduce is None or not options.straggler_margin:
            return None
        tasks = worker_tasks(strategy)
        return cls(strategy, options, tasks) if len(tasks) > 1 else None

    def loop_done(self, steps: int) -> None:
        if steps > 0:
            self._seconds_per_step = self.clock.seconds_per_step(steps)

    def figures(self) -> list[float]:
        """What this worker adds to the agreement: its seconds per step in its own slot."""
        slots = [0.0] * len(self.watch.tasks)
        slots[self._own] = self._seconds_per_step
        return slots

    def agreed(self, figures: Sequence[float], step: int, summaries: Any) -> None:
        """Every worker's figures as the agreement summed them: compared, logged, written."""
        if len(figures) != len(self.watch.tasks) or not all(seconds > 0 for seconds in figures):
            return  # Before the first loop (or a worker without a figure yet).
        for line in self.watch.observe(figures):
            logger.warning("%s", line)
        scalars = {
            f"{SCALAR_PREFIX}{name.replace(':', '_')}": seconds for name, seconds in self.watch.last.items()
        }
        summaries.write("train", step, scalars)
