"""Parameter-server training: the runners the coordinator's Trainer (`engine.trainer.coordinated`) runs.

The chief process is the coordinator. Variables live on the ps tasks (made
in `strategy.scope()` as usual); each worker gets its own input pipeline
through `ClusterCoordinator.create_per_worker_dataset`; every compiled loop
is the SAME `compiled.make_train_loop` function as on one host, scheduled on
whichever worker is free. A worker that dies takes its closure with it and
the coordinator reschedules it on another worker, so training goes on.

What differs from one host, and why:
- Each loop of N steps is cut into one closure per worker, run in parallel
  (asynchronous updates: that is what parameter-server training is).
- The coordinator counts the steps it scheduled: a retried closure may have
  applied some of its steps already, so counting inside the closure would
  overshoot the requested step.
- Data: worker i of W reads global batches start+i, start+i+W, ... of the
  same seeded stream, so workers do not train on the same examples, and a
  restart resumes at the checkpointed step. Which worker takes which
  closure is up to the scheduler, so the order is not reproducible.
- Evaluation runs on the coordinator over the whole eval set, in global
  batches: every example counts once, as on one host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from engine.compat import num_workers
from engine.data import DataForm, eval_dataset_on_one_replica, pipeline_at
from engine.loop.compiled import CHECK_NONE, LoopResult, make_train_loop
from engine.loop.runners import EvalRunner, PredictRunner, TrainRunner
from engine.loop.steps import STEP_EXAMPLES, ReplicaStep
from engine.resident import ResidentData, ResidentEvalData


class CoordinatedTrainRunner(TrainRunner):
    """Runs each training call as one closure per worker, scheduled by the coordinator."""

    def __init__(
        self,
        coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator,
        replica_step: ReplicaStep,
        global_step: tf.Variable,
        data: DataForm,
        *,
        global_batch_size: int,
        max_loss: float | None = None,
    ):
        self.coordinator = coordinator
        self.global_step = global_step
        super().__init__(
            coordinator.strategy,
            replica_step,
            global_step,
            data,
            global_batch_size=global_batch_size,
            max_loss=max_loss,
        )
        self.num_workers = num_workers(coordinator.strategy)

    def _make_loop(self, global_step: tf.Variable | None):
        # The same replica step and loop as on one host, minus the in-loop step count.
        return make_train_loop(self.strategy, self.replica_step, global_step=None, max_loss=self.max_loss)

    def release_iterator(self) -> None:
        """Kept: the workers' iterators live on the workers, and their streams run on by themselves."""

    def run(self, start_step: int, num_steps: int) -> LoopResult:
        """Schedules the call as one closure per worker; waits for all of them. The
        per-worker iterators are built once: the workers' streams run on by themselves."""
        if self._iterator is None:
            assert not isinstance(self.data, ResidentData), "checked by CoordinatedTrainer"
            dataset_fn = per_worker_dataset_fn(self.strategy, self.data, start_step, self.num_workers)
            self._iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        chunks = split_steps(num_steps, self.num_workers)
        no_check = tf.constant(CHECK_NONE, tf.int32)  # Remote calls bind every argument.
        scheduled = [
            (
                steps,
                self.coordinator.schedule(
                    self.loop, args=(self._iterator, tf.constant(steps, tf.int32), no_check)
                ),
            )
            for steps in chunks
        ]
        self.coordinator.join()
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        nonfinite_steps, first_nonfinite, offset, steps_run = 0, -1, 0, 0
        first_nonfinite_loss = float("nan")
        for steps, remote in scheduled:
            result = LoopResult.from_outputs(remote.fetch())
            nonfinite_steps += result.nonfinite_steps
            steps_run += result.steps_run
            if result.first_nonfinite_index >= 0 and first_nonfinite < 0:
                # In scheduling order; closures run in parallel.
                first_nonfinite = offset + result.first_nonfinite_index
                first_nonfinite_loss = result.first_nonfinite_loss
            offset += steps
            for name, value in result.logs.items():
                # The loss weighted by the examples, as within each worker's loop (engine.loop.compiled).
                examples = result.logs.get(STEP_EXAMPLES) if name == "loss" else None
                weight = steps * (1.0 if examples is None else examples)
                totals[name] = totals.get(name, 0.0) + weight * value
                weights[name] = weights.get(name, 0.0) + weight
        self.global_step.assign_add(steps_run)  # Fewer than num_steps where a worker's data ran out.
        return LoopResult(
            logs={name: total / weights[name] if weights[name] else 0.0 for name, total in totals.items()},
            steps_run=steps_run,
            nonfinite_steps=nonfinite_steps,
            first_nonfinite_index=first_nonfinite,
            first_nonfinite_loss=first_nonfinite_loss,
        )


class CoordinatorEvalRunner(EvalRunner):
    """Exact evaluation on the coordinator, in global batches: reads the weights from the ps tasks."""

    def _run_calls(self, stop_requested: Callable[[], bool]) -> bool:
        assert not isinstance(self.data, ResidentEvalData), "checked by CoordinatedTrainer"
        data = eval_dataset_on_one_replica(self.data)
        with _quiet_tf_warnings():  # "invoked without ClusterCoordinator.schedule": intended here.
            return self._calls_until_exhausted(iter(data), stop_requested)


class CoordinatorPredictRunner(PredictRunner):
    """Predictions on the coordinator, batch by batch in order: reads the weights from the ps tasks."""

    def _outputs(self, dataset: tf.data.Dataset) -> Any:
        on_coordinator = tf.function(self._replica_outputs)
        with _quiet_tf_warnings():  # "invoked without ClusterCoordinator.schedule": intended here.
            for batch in dataset:
                yield on_coordinator(batch)


@contextlib.contextmanager
def _quiet_tf_warnings():
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def per_worker_dataset_fn(strategy: tf.distribute.Strategy, data: DataForm, start_step: int, num_workers: int):
    """What `create_per_worker_dataset` runs on each worker: this worker's
    share of the global-batch stream from `start_step` on."""

    def worker_dataset(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        # The strategy gives each worker one pipeline of one replica: global batches.
        dataset = pipeline_at(data, input_context, start_step=start_step)
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return dataset.shard(num_workers, worker)

    def dataset_fn():
        return strategy.distribute_datasets_from_function(worker_dataset)

    return dataset_fn


def split_steps(num_steps: int, parts: int) -> list[int]:
    """`num_steps` as at most `parts` near-equal positive chunks."""
    parts = max(1, min(parts, num_steps))
    base, extra = divmod(num_steps, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]
