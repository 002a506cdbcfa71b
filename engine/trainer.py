"""The outer loop: when to train, evaluate, save, log and stop.

The compiled work lives in `loop.py`; this module only decides how many
steps the next compiled call runs (never past the next evaluation,
checkpoint or the target step) and what happens between calls. Everything
here runs once per loop, not once per step.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import keras
import tensorflow as tf
from absl import logging

from engine import checkpoint as checkpoint_lib
from engine import model_dir as model_dir_lib
from engine.callbacks import CallbackLike, as_callbacks
from engine.distribute import Data, distribute_eval_data, distribute_train_data
from engine.errors import UserError
from engine.loop import make_eval_loop, make_train_loop
from engine.progress import Progress
from engine.steps import PerExampleLoss, ReplicaStep, make_eval_step, make_train_step
from engine.summaries import SummaryWriters

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteLossError(UserError):
    """Training produced a NaN or Inf loss and was stopped (on_nonfinite="stop")."""


class Trainer:
    """Distributed, compiled custom training loop with eval, summaries and checkpoints.

    Create the model and optimizer inside `strategy.scope()`. Pass
    `loss_fn` (per-example losses from `(labels, logits)`; the engine does
    the cross-replica averaging) and/or `step_fn` (your own per-replica step
    returning a dict of scalars; then the loss scaling is yours). Evaluation
    uses `loss_fn` and `metrics`.

    The latest checkpoint in `model_dir` is restored on construction, so
    `trainer.global_step` says where training continues from.
    """

    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        model: Any,
        optimizer: keras.optimizers.Optimizer,
        train_data: Data,
        global_batch_size: int,
        loss_fn: PerExampleLoss | None = None,
        step_fn: ReplicaStep | None = None,
        metrics: Sequence[keras.metrics.Metric] = (),
        eval_data: Data | None = None,
        model_dir: str | None = None,
        steps_per_loop: int = 100,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        max_checkpoints: int = 3,
        clip_norm: float | None = None,
        grad_accum_steps: int = 1,
        jit_compile: bool = False,
        callbacks: Sequence[CallbackLike] = (),
        log_every: int | None = None,
        on_nonfinite: str = "stop",
        restore_fallback: bool = False,
        restore_dir: str | None = None,
        reset_optimizer: bool = False,
    ):
        if loss_fn is None and step_fn is None:
            raise UserError("pass loss_fn, step_fn or both to Trainer")
        if eval_data is not None and loss_fn is None:
            raise UserError("evaluation needs loss_fn (per-example losses) besides step_fn")
        if steps_per_loop < 1:
            raise UserError(f"steps_per_loop={steps_per_loop} must be at least 1")
        _check_batch(global_batch_size, strategy.num_replicas_in_sync, grad_accum_steps)
        if on_nonfinite not in NONFINITE_POLICIES:
            raise UserError(f"on_nonfinite={on_nonfinite!r} must be one of: {', '.join(NONFINITE_POLICIES)}")
        self.on_nonfinite = on_nonfinite
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.steps_per_loop = steps_per_loop
        self.eval_every = eval_every or None
        self.checkpoint_every = checkpoint_every or None
        self._train_data = train_data
        # A non-chief worker writes to a private model_dir but resumes from the chief's.
        self._restore_dir = restore_dir
        self._eval_data = eval_data
        self.model_dir = model_dir
        self.target_step: int | None = None  # The `steps` of the running train() call.
        self._summaries = SummaryWriters(model_dir)
        self._iterator = None
        self._iterator_step = -1
        self._steady_seconds = 0.0
        self._steady_steps = 0
        self._compiled_once = False
        self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, logs)
        # Progress lines every `log_every` steps (every loop when None) come first.
        self.callbacks = [Progress(log_every), *as_callbacks(callbacks)]
        self.stop_training = False  # Set by a callback to stop after this loop.
        self._stop_requested = False  # Set by request_stop(); survives train() calls.

        with strategy.scope():
            _check_created_in_scope(strategy, model)
            if not optimizer.built:
                # Keras 3 optimizers must create their slots eagerly in the
                # scope before the first traced step (and before a restore).
                optimizer.build(model.trainable_variables)
            self.global_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="global_step",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.train_metrics = [_fresh_copy(m) for m in metrics]
            self.eval_metrics = [_fresh_copy(m) for m in metrics]
            self._eval_loss = keras.metrics.Mean(name="loss")
            self._eval_count = keras.metrics.Sum(name="num_examples")

        if step_fn is None:
            step_fn = make_train_step(
                model=model, optimizer=optimizer, loss_fn=loss_fn,
                global_batch_size=global_batch_size, metrics=self.train_metrics,
                clip_norm=clip_norm, grad_accum_steps=grad_accum_steps,
                jit_compile=jit_compile, skip_nonfinite=on_nonfinite == "skip",
            )
        self.replica_step = step_fn
        self.train_loop = make_train_loop(strategy, step_fn, self.global_step)
        self._stop_agreement = _make_stop_agreement(strategy)
        self.eval_loop = None
        if self._eval_data is not None:
            self.eval_loop = make_eval_loop(strategy, make_eval_step(
                model=model, loss_fn=loss_fn, loss_metric=self._eval_loss,
                count_metric=self._eval_count, metrics=self.eval_metrics,
            ))

        self.checkpoint_manager = None
        self._reset_optimizer = reset_optimizer
        if model_dir is not None:
            model_dir_lib.check_name(model_dir)
            checkpoint_lib.set_aside_unreadable(model_dir, fallback=restore_fallback)
            checkpoint = tf.train.Checkpoint(
                model=model, optimizer=optimizer, global_step=self.global_step
            )
            self.checkpoint_manager = checkpoint_lib.make_manager(
                model_dir, checkpoint, max_to_keep=max_checkpoints,
                step_counter=self.global_step,
            )
            self._restore()

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        return int(self.global_step.numpy())

    def _restore(self) -> None:
        learning_rate = _constant_learning_rate(self.optimizer)
        path = checkpoint_lib.restore_latest(self.checkpoint_manager, directory=self._restore_dir,
                                             fresh_optimizer=self._reset_optimizer)
        if path is None:
            return
        if learning_rate is not None and not any(c.owns_learning_rate for c in self.callbacks):
            # The checkpoint holds the old run's learning rate; the optimizer
            # the user passed now (e.g. a new --learning_rate) wins, unless a
            # hook (reduce on plateau) set the rate and must find it again.
            self.optimizer.learning_rate = learning_rate
        logging.info("Restored %s at step %d", path, self.step)

    def save(self) -> str | None:
        """Writes a checkpoint at the current step (no-op without model_dir)."""
        if self.checkpoint_manager is None:
            return None
        step = self.step
        if not _all_finite(self.model):
            raise UserError(f"the weights hold NaN or Inf at step {step}; not saved, the latest checkpoint "
                            f"({self.checkpoint_manager.latest_checkpoint or 'none'}) is kept")
        model_dir_lib.set_aside_unlisted(self.checkpoint_manager.directory, step,
                                         listed=self.checkpoint_manager.checkpoints)
        try:
            path = self.checkpoint_manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as error:
            message = model_dir_lib.disk_full_message(self.checkpoint_manager.directory, error)
            if message is None:
                raise
            model_dir_lib.remove_orphan_temps(self.checkpoint_manager.directory)  # This save's ckpt-N_temp.
            raise UserError(f"checkpoint at step {step} not saved: {message}; the latest checkpoint "
                            f"({self.checkpoint_manager.latest_checkpoint or 'none'}) is kept") from None
        logging.info("Saved checkpoint %s", path)
        return path

    # ---------------------------------------------------------------- training

    def request_stop(self) -> None:
        """Stops training after the current loop (with a checkpoint); safe to
        call from a signal handler, and it stays in force for later train() calls."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def _should_stop(self) -> bool:
        """Whether to stop before the next loop, agreed by every worker.

        A signal reaches one process, but multi-worker training only ends
        cleanly if all workers stop at the same step (otherwise the others
        wait in their next all-reduce). So with several workers a stop
        request is all-reduced once per loop, and a worker that learns of a
        peer's request takes it as its own. Callbacks decide from all-reduced
        metrics and so agree already.
        """
        if self.stop_training:
            return True
        if self._stop_agreement is not None:
            wanted = tf.constant(1.0 if self._stop_requested else 0.0)
            if float(self._stop_agreement(wanted)) > 0:
                self._stop_requested = True
        return self._stop_requested

    def train(self, steps: int) -> dict[str, float]:
        """Trains until the global step reaches `steps`; returns the last loop's logs.

        `steps` is an absolute target, so a restarted job with the same
        arguments does only the remaining work.
        """
        if steps < 0:
            raise UserError(f"train steps={steps} must not be negative")
        logs: dict[str, float] = {}
        last_saved = self.step
        self.target_step = steps
        self.stop_training = False
        for callback in self.callbacks:
            callback.on_train_begin(self)
        while self.step < steps and not self._should_stop():
            start = self.step
            num_steps = self._next_loop_length(start, steps)
            iterator = self._train_iterator(start)
            for metric in self.train_metrics:
                metric.reset_state()
            began = time.perf_counter()
            logs = self._run_train_loop(iterator, num_steps)
            first_nonfinite = int(logs.pop("first_nonfinite_index"))
            nonfinite_steps = logs.pop("nonfinite_steps")
            if self.on_nonfinite == "skip":  # Under "stop" it is 0, or the run ends below.
                logs["nonfinite_steps"] = nonfinite_steps
            seconds = time.perf_counter() - began
            self._iterator_step = start + num_steps
            if first_nonfinite >= 0 and self.on_nonfinite == "stop":
                self._stop_on_nonfinite(start + first_nonfinite + 1)
            logs.update({m.name: float(m.result()) for m in self.train_metrics})
            logs.update(self._speed(num_steps, seconds))
            logs["learning_rate"] = _current_learning_rate(self.optimizer)
            self._summaries.write("train", self.step, logs)
            for callback in self.callbacks:
                callback.on_loop_end(self, self.step, logs)
            if self._due(self.eval_every) and self.eval_loop is not None:
                self.evaluate()
            if self._due(self.checkpoint_every):
                self.save()
                last_saved = self.step
        if self.step != last_saved or (self.checkpoint_manager is not None
                                       and self.checkpoint_manager.latest_checkpoint is None):
            self.save()
        for callback in self.callbacks:
            callback.on_train_end(self, logs)
        return logs

    def _stop_on_nonfinite(self, step: int) -> None:
        """Ends the run without saving: the weights may already hold NaNs."""
        latest = self.checkpoint_manager.latest_checkpoint if self.checkpoint_manager else None
        self._summaries.close()
        raise NonFiniteLossError(
            f"non-finite loss at step {step}; stopped without saving, the latest checkpoint "
            f"({latest or 'none'}) is kept; lower --learning_rate, set --clip_norm, or pass "
            "--on_nonfinite=skip to skip such steps"
        )

    def _run_train_loop(self, iterator, num_steps: int) -> dict[str, float]:
        """One compiled call of `num_steps` steps (the parameter-server trainer
        schedules it on workers instead)."""
        outputs = self.train_loop(iterator, tf.constant(num_steps, tf.int32))
        return {name: float(value) for name, value in outputs.items()}

    def _next_loop_length(self, start: int, target: int) -> int:
        length = min(self.steps_per_loop, target - start)
        for every in (self.eval_every, self.checkpoint_every):
            if every:
                length = min(length, every - start % every)
        for callback in self.callbacks:
            limit = callback.loop_limit(self, start)
            if limit:
                length = min(length, limit)
        return length

    def _due(self, every: int | None) -> bool:
        return bool(every) and self.step % every == 0

    def _train_iterator(self, start_step: int):
        if self._iterator is None or self._iterator_step != start_step:
            dataset = distribute_train_data(self.strategy, self._train_data, start_step=start_step)
            self._iterator = iter(dataset)
            self._iterator_step = start_step
        return self._iterator

    def _speed(self, num_steps: int, seconds: float) -> dict[str, float]:
        """Throughput of this loop; the first loop (tracing, compiling) is left
        out of the steady rate that `examples_per_second` reports."""
        if self._compiled_once:
            self._steady_seconds += seconds
            self._steady_steps += num_steps
        self._compiled_once = True
        return {
            "steps_per_second": num_steps / seconds,
            "examples_per_second": num_steps * self.global_batch_size / seconds,
        }

    @property
    def summaries(self) -> SummaryWriters:
        """The TensorBoard writers (one a split), for hooks that write more than scalars."""
        return self._summaries

    @property
    def steady_examples_per_second(self) -> float | None:
        """Examples/s over every loop but the first; None until there are two."""
        if not self._steady_steps:
            return None
        return self._steady_steps * self.global_batch_size / self._steady_seconds

    # -------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        """Runs over the whole eval set once; metrics cover every example.

        A stop request (`request_stop`) ends it after the running chunk of at
        most `steps_per_loop` batches; it then returns {} and records nothing.
        """
        if self.eval_loop is None:
            raise UserError("evaluate() needs eval_data and a loss_fn")
        for metric in (self._eval_loss, self._eval_count, *self.eval_metrics):
            metric.reset_state()
        if not self._run_eval_loop():
            logging.warning("evaluation at step %d stopped by a stop request; no eval results", self.step)
            return {}
        logs = {"loss": float(self._eval_loss.result())}
        logs.update({m.name: float(m.result()) for m in self.eval_metrics})
        logs["num_examples"] = int(round(float(self._eval_count.result())))
        self._summaries.write("eval", self.step, logs)
        logging.info("eval at step %d  %s", self.step, _format(logs))
        self.last_eval = (self.step, logs)
        for callback in self.callbacks:
            callback.on_eval_end(self, self.step, logs)
        return logs

    def _run_eval_loop(self) -> bool:
        return self._run_eval_chunks(iter(distribute_eval_data(self.strategy, self._eval_data)))

    def _run_eval_chunks(self, iterator) -> bool:
        """Evaluates in compiled calls of `steps_per_loop` batches, checking for a
        stop request between them; False when one cut the evaluation short."""
        chunk = tf.constant(self.steps_per_loop, tf.int32)
        while not bool(self.eval_loop(iterator, chunk)):
            # Several workers must run the same chunks (each batch is agreed by all-reduce).
            if self._stop_requested and self._stop_agreement is None:
                return False
        return True

    def evaluate_current(self) -> dict[str, float]:
        """The evaluation at the current step, reusing one the loop already ran."""
        if self.last_eval is not None and self.last_eval[0] == self.step:
            return self.last_eval[1]
        return self.evaluate()

    def close(self) -> None:
        self._summaries.close()


def _make_stop_agreement(strategy: tf.distribute.Strategy):
    """A compiled `any(flag over all workers)` for multi-worker mirrored
    training; None where one process decides alone."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    if strategy.extended._num_workers < 2:  # noqa: SLF001 (no public worker count)
        return None

    @tf.function
    def any_worker(flag: tf.Tensor) -> tf.Tensor:
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return any_worker


def _check_batch(global_batch_size: int, num_replicas: int, grad_accum_steps: int) -> None:
    if global_batch_size < 1:
        raise UserError(f"global batch size {global_batch_size} must be positive")
    if grad_accum_steps < 1:
        raise UserError(f"grad_accum_steps={grad_accum_steps} must be at least 1")
    if global_batch_size % (num_replicas * grad_accum_steps):
        raise UserError(
            f"global batch size {global_batch_size} is not divisible by "
            f"{num_replicas} replica(s) x {grad_accum_steps} accumulation step(s); "
            f"use a multiple of {num_replicas * grad_accum_steps}"
        )


def _check_created_in_scope(strategy: tf.distribute.Strategy, model: Any) -> None:
    for variable in model.trainable_variables[:1]:
        if isinstance(variable, keras.Variable):
            variable = variable.value  # The tf.Variable inside a Keras variable.
        if not strategy.extended.variable_created_in_scope(variable):
            raise UserError(
                "the model's variables were created outside strategy.scope(); "
                "build the model and optimizer inside `with strategy.scope():`"
            )


def _all_finite(model: Any) -> bool:
    """Whether every floating-point weight of the model is finite (checked before each save)."""
    values = []
    for variable in model.variables:
        if isinstance(variable, keras.Variable):
            variable = variable.value
        if variable.dtype.is_floating:
            values.append(tf.reduce_all(tf.math.is_finite(variable)))
    return bool(tf.reduce_all(values)) if values else True


def _fresh_copy(metric: keras.metrics.Metric) -> keras.metrics.Metric:
    """A new, empty metric of the same config, created in the current scope."""
    return type(metric).from_config(metric.get_config())


def _constant_learning_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    schedule = getattr(optimizer, "_learning_rate", None)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule) or callable(schedule):
        return None
    return _current_learning_rate(optimizer)


def _current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    # A distributed Keras variable does not convert with float(); read it as a tensor.
    return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())


def _format(logs: Mapping[str, float]) -> str:
    return "  ".join(
        f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in logs.items()
    )
