"""The runners: what one training call, one evaluation and one prediction do, apart from when.

The `Trainer` (the outer loop) decides when to train, evaluate and save;
a `TrainRunner` runs one compiled call of N training steps from wherever
the data stands, an `EvalRunner` one pass over the whole eval set, and a
`PredictRunner` the model's outputs for every example of a data set.
The checkpoint evaluator (`engine.cli.run.evaluator`) uses an `EvalRunner`
alone: it never trains. The parameter-server forms of both live in
`engine.loop.ps_runners`.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from engine import compat
from engine.data import (
    DataForm,
    DataPosition,
    distribute_eval_data,
    distribute_train_data,
    service_resume_note,
    yields_global_batches,
)
from engine.errors import UserError, one_line
from engine.logger import logger
from engine.loop.compiled import (
    CHECK_EXACT,
    CHECK_NONE,
    CHECK_NOT_LARGER,
    BatchSizeMismatch,
    LoopResult,
    make_eval_loop,
    make_resident_eval_loop,
    make_resident_train_loop,
    make_train_loop,
)
from engine.loop.iterator_release import leave_unfreed, release_in_background
from engine.loop.steps import EvalStep, ReplicaStep, inference_outputs, make_eval_step
from engine.losses import EvalLoss, Objective
from engine.metric_values import metric_logs
from engine.resident import ResidentData, ResidentEvalData, place_on_replicas
from engine.stragglers import InputClock


class TrainRunner:
    """Runs compiled training calls of the replica step over the training data.

    Args:
      strategy: the strategy the model was built under.
      replica_step: the per-replica step (the standard one or the user's).
      global_step: counted up by each step the loop runs.
      data: the training data's declared form, or `ResidentData` kept on the devices.
      global_batch_size: examples per step over all replicas.
      position: the offset of the stream position from the global step (batches skipped
        by rollbacks); None: none, the position is the step.
      max_loss: a step whose loss is above it counts as non-finite (`engine.loop.compiled`).
      replica_state: variables each replica updates on its own, averaged after every call
        (`engine.loop.replica_state`).
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        replica_step: ReplicaStep,
        global_step: tf.Variable,
        data: DataForm | ResidentData,
        *,
        global_batch_size: int,
        position: DataPosition | None = None,
        max_loss: float | None = None,
        replica_state: Sequence[Any] = (),
        input_clock: InputClock | None = None,
    ):
        self.strategy = strategy
        self.input_clock = input_clock  # Times the iterator's waits (engine.stragglers); None: not timed.
        self.replica_step = replica_step
        self.replica_state = list(replica_state)
        self.global_batch_size = global_batch_size
        self.data = data
        self.position = position
        self.max_loss = max_loss
        self._iterator: Any = None
        self._iterator_position = -1  # The stream position of the iterator's next batch.
        self._replica_tensors: Any = None  # ResidentData's copies on the replicas, made at the first call.
        self.loop = self._make_loop(global_step)
        _LIVE_TRAIN_RUNNERS.add(self)

    def _make_loop(self, global_step: tf.Variable | None):
        if isinstance(self.data, ResidentData):
            assert global_step is not None, "resident data is never scheduled by a coordinator"
            return make_resident_train_loop(
                self.strategy,
                self.replica_step,
                global_step,
                self.data,
                global_batch_size=self.global_batch_size,
                max_loss=self.max_loss,
                replica_state=self.replica_state,
                keep_last=getattr(self.replica_step, "running_values", False),
            )
        return make_train_loop(
            self.strategy,
            self.replica_step,
            global_step,
            per_replica_batch_size=self.global_batch_size // self.strategy.num_replicas_in_sync,
            max_loss=self.max_loss,
            keep_last=getattr(self.replica_step, "running_values", False),
            replica_state=self.replica_state,
            input_clock=self.input_clock,
        )

    @property
    def keeps_data_on_devices(self) -> bool:
        return isinstance(self.data, ResidentData)

    def run(self, start_step: int, num_steps: int) -> LoopResult:
        """One compiled call of at most `num_steps` steps, the first at global step `start_step`.

        A run's first batch must be a full one; after a resume (or inside the
        stream) a smaller one is the data's partial last batch, trained as
        Keras `fit` trains it.

        The data are read from the stream position of `start_step` (`position`): the
        step itself, or past the batches rollbacks skipped.

        Raises:
          UserError: the first batch does not hold `global_batch_size` examples (nothing ran).
        """
        at = start_step if self.position is None else self.position.at(start_step)
        if isinstance(self.data, ResidentData):  # Gathered from the position: always full batches.
            return LoopResult.from_outputs(self.loop(self._resident_input(at), tf.constant(num_steps)))
        fresh = self._iterator is None or self._iterator_position != at
        if fresh:
            self.release_iterator()  # One read from elsewhere in the stream (a restore, a rollback).
            _say_where_input_comes_from(self.data, at)
            self._iterator = iter(distribute_train_data(self.strategy, self.data, start_step=at))
        check = CHECK_NONE if not fresh else (CHECK_EXACT if at == 0 else CHECK_NOT_LARGER)
        try:
            result = self._checked_call(num_steps, check, start_step)
        except BaseException:
            # Where a call that raised left the stream is unknown: the next call makes an iterator
            # at its own position. This one is freed on the release thread once the traceback's
            # frames let go of it too (`engine.loop.iterator_release`).
            self.release_iterator()
            raise
        self._iterator_position = at + result.steps_run
        return result

    def _checked_call(self, num_steps: int, check: int, start_step: int) -> LoopResult:
        try:
            result = self._call(self._iterator, num_steps, check)
        except BatchSizeMismatch as mismatch:  # Found while tracing: nothing ran.
            raise UserError(self._batch_size_message(mismatch.size, start_step)) from None
        if result.first_batch_size >= 0:  # Found by the loop, which then ran no step.
            raise UserError(self._batch_size_message(result.first_batch_size, start_step))
        return result

    def release_iterator(self) -> None:
        """Lets go of the training iterator, freed on the release thread (freeing a distributed
        iterator can wait seconds: `engine.loop.iterator_release`); the next call makes another."""
        if self._iterator is not None:
            iterators, self._iterator = [self._iterator], None
            release_in_background(iterators)

    def leave_iterator_unfreed(self) -> None:
        """At the process's exit: lets go of the training iterator without freeing it
        (`iterator_release.leave_unfreed`); the next call would make another."""
        if self._iterator is not None:
            iterators, self._iterator = [self._iterator], None
            leave_unfreed(iterators)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # A Trainer dropped without close() (a research loop making one per trial, a test)
        # would otherwise free its iterator on the thread that drops it, which can wait up to
        # a minute. During the interpreter's shutdown no thread can start, and the module's
        # globals may be gone already (`sys` was None: a traceback per Trainer at the exit of
        # every research script), hence `_finalizing` bound here.
        if not _finalizing() and getattr(self, "_iterator", None) is not None:
            self.release_iterator()

    def _call(self, iterator: Any, num_steps: int, first_batch_check: int) -> LoopResult:
        outputs = self.loop(iterator, tf.constant(num_steps, tf.int32), tf.constant(first_batch_check, tf.int32))
        return LoopResult.from_outputs(outputs)

    def _resident_input(self, start_position: int) -> tuple[Any, tf.Tensor]:
        if self._replica_tensors is None:
            assert isinstance(self.data, ResidentData), "only for resident data"
            self._replica_tensors = place_on_replicas(self.strategy, self.data)
        return self._replica_tensors, tf.constant(start_position, tf.int64)

    def _batch_size_message(self, per_replica: int, step: int) -> str:
        replicas = self.strategy.num_replicas_in_sync
        untouched = "nothing was trained" if step == 0 else f"no update was applied after step {step}"
        assert not isinstance(self.data, ResidentData), "resident batches are always full"
        if yields_global_batches(self.data):
            return (
                f"train_data's first batch holds {per_replica * replicas} examples but "
                f"`global_batch_size={self.global_batch_size}`; batch the dataset by "
                f"{self.global_batch_size} (global batches) or change `global_batch_size`; {untouched}"
            )
        return (
            f"train_data's first batch holds {per_replica} examples per replica but "
            f"`global_batch_size={self.global_batch_size}` over {replicas} replica(s) needs "
            f"{self.global_batch_size // replicas}; batch by "
            f"input_context.get_per_replica_batch_size(global_batch_size); {untouched}"
        )


def _say_where_input_comes_from(form: DataForm, position: int) -> None:
    """A run fed by a tf.data service says so when it starts reading, and what a start past
    the stream's beginning (a resume, a rollback) means there (`service_resume_note`)."""
    if form.service is None:
        return
    if position == 0:
        logger.info("input: %s", form.service.describe())
    else:
        logger.warning("%s", service_resume_note(form.service, position))


class EvalRunner:
    """Exact evaluation: every example of the eval set once, Keras `evaluate`'s numbers.

    Evaluates in compiled calls of `batches_per_call` batches so that a stop
    request is seen between them. The loss is the objective's over the whole
    set (`engine.losses.EvalLoss`) plus the model's regularization losses; `metrics` see no sample weights,
    `weighted_metrics` do (Keras `compile`'s split). Fresh copies of the
    metrics are made in the strategy's scope. `ResidentEvalData` is read from the
    replicas' own copies (made at the first evaluation), with no iterator.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model: Any,
        objective: Objective,
        data: DataForm | ResidentEvalData,
        *,
        metrics: Sequence[keras.metrics.Metric] = (),
        weighted_metrics: Sequence[keras.metrics.Metric] = (),
        eval_step_fn: EvalStep | None = None,
        batches_per_call: int,
    ):
        self.strategy = strategy
        self.data = data
        self.batches_per_call = batches_per_call
        with strategy.scope():
            unweighted = [fresh_copy(m, model) for m in metrics]
            weighted = [fresh_copy(m, model) for m in weighted_metrics]
            self.loss = EvalLoss(objective)
        self.metrics = [*unweighted, *weighted]
        self.output_names = objective.term_names(model)  # Each output's loss is logged as Keras names it.
        step = make_eval_step(
            model=model,
            objective=objective,
            loss_metric=self.loss,
            metrics=unweighted,
            weighted_metrics=weighted,
            eval_step_fn=eval_step_fn,
        )
        if isinstance(data, ResidentEvalData):
            self.loop = make_resident_eval_loop(strategy, step, data)
        else:
            self.loop = make_eval_loop(strategy, step)
        self._replica_tensors: Any = None  # ResidentEvalData's copies on the replicas, made at the first run.

    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        """`{"loss", <metric>..., "num_examples"}` over the whole set; None when
        `stop_requested()` turned True between two calls and cut it short."""
        for metric in (self.loss, *self.metrics):
            metric.reset_state()
        if not self._run_calls(stop_requested):
            return None
        logs = {"loss": float(self.loss.result())}
        if self.output_names:
            terms = self.loss.term_results().numpy()
            logs.update({f"{name}_loss": float(t) for name, t in zip(self.output_names, terms, strict=True)})
        logs.update(metric_logs(self.metrics))  # A vector-valued one per entry (`f1_score/0`, ...).
        logs["num_examples"] = int(round(float(self.loss.examples_seen())))
        return logs

    def _run_calls(self, stop_requested: Callable[[], bool]) -> bool:
        if isinstance(self.data, ResidentEvalData):
            return self._resident_calls(self.data, stop_requested)
        # Freed on another thread: freeing it here can block the loop for seconds
        # (`engine.loop.iterator_release`).
        iterators = [iter(distribute_eval_data(self.strategy, self.data))]
        try:
            return self._calls_until_exhausted(iterators[0], stop_requested)
        finally:
            release_in_background(iterators)

    def _calls_until_exhausted(self, iterator: Any, stop_requested: Callable[[], bool]) -> bool:
        batches = tf.constant(self.batches_per_call, tf.int32)
        while not bool(self.loop(iterator, batches)):
            if stop_requested():
                return False
        return True

    def _resident_calls(self, data: ResidentEvalData, stop_requested: Callable[[], bool]) -> bool:
        if self._replica_tensors is None:
            self._replica_tensors = place_on_replicas(self.strategy, data)
        batches = tf.constant(self.batches_per_call, tf.int32)
        for first_batch in range(0, data.num_batches, self.batches_per_call):
            if first_batch and stop_requested():
                return False
            self.loop((self._replica_tensors, tf.constant(first_batch, tf.int32)), batches)
        return True


class PredictRunner:
    """The model's outputs for every example, in the data's order, computed over the replicas.

    Each global batch is split over the replicas (a partial last batch too, a replica
    may get none) and the outputs are gathered back in replica order, which is the
    batch's own order: row i of the result is example i of the data, as `model.predict`
    returns it.
    """

    def __init__(self, strategy: tf.distribute.Strategy, model: Any, *, own_predict_step: bool = False):
        """`own_predict_step`: the model's own `predict_step` makes each replica's outputs, as
        in Keras `predict` (`engine.keras_model`)."""
        self.strategy = strategy
        self.model = model

        @compat.engine_graph_code
        def replica_outputs(batch: Any) -> Any:
            if own_predict_step:
                return compat.user_code(model.predict_step)(batch)
            features, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
            return inference_outputs(model, features)

        @tf.function
        def predict_batch(iterator: Any) -> Any:
            # The iterator, not the batch, is the argument: its spec (batch size unknown) is the
            # same for every batch, so a partial last batch does not trace the function again.
            batch = next(iterator)
            outputs = strategy.run(replica_outputs, args=(batch,))
            # Leaf by leaf: `strategy.gather` of a nest (list or dict outputs) returns replica 0's
            # rows alone, silently (TF 2.21).
            return tf.nest.map_structure(lambda output: strategy.gather(output, axis=0), outputs)

        self._replica_outputs = replica_outputs
        self.loop = predict_batch

    def run(self, dataset: tf.data.Dataset) -> Any:
        """Outputs (numpy, nested as the model's) for every example of `dataset`, a finite
        `tf.data.Dataset` of global batches of features or of `(features, labels[, weights])`."""
        batches = [tf.nest.map_structure(np.asarray, outputs) for outputs in self._outputs(dataset)]
        if not batches:
            raise UserError("predict() got a dataset with no batches; pass at least one example")
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *batches)

    def _outputs(self, dataset: tf.data.Dataset) -> Any:
        # Freed on another thread, as an evaluation's is (`engine.loop.iterator_release`).
        iterators = [iter(self.strategy.experimental_distribute_dataset(dataset))]
        try:
            while True:
                try:
                    yield self.loop(iterators[0])
                except tf.errors.OutOfRangeError:  # The end of the data.
                    return
        finally:
            release_in_background(iterators)


def as_prediction_batches(data: Any, global_batch_size: int) -> tf.data.Dataset:
    """`predict()`'s input as a dataset of global batches: a `tf.data.Dataset` (already
    batched) as it is; the features as arrays (a dict, tuple or list of them for a model of
    several inputs, as Keras `predict` takes them) batched by `global_batch_size`."""
    if isinstance(data, tf.data.Dataset):
        return data
    if isinstance(data, list) and data and all(isinstance(item, (np.ndarray, tf.Tensor)) for item in data):
        data = tuple(data)  # A model's several inputs, as Keras predict takes them.
    if isinstance(data, (np.ndarray, tf.Tensor, Mapping, tuple)):
        # One-element batches `(features,)`: the features of a model of several inputs, not
        # (features, labels) read from a pair of arrays.
        return tf.data.Dataset.from_tensor_slices((data,)).batch(global_batch_size)
    raise UserError(
        f"predict() takes a tf.data.Dataset of global batches or arrays of examples, got {type(data).__name__}"
    )


def fresh_copy(metric: keras.metrics.Metric, model: Any = None) -> keras.metrics.Metric:
    """A new, empty metric of the same config, created in the current scope (a strategy's),
    its variables made now even where Keras makes them on the first update (`model`'s
    output shape says their shape): made inside a step on several replicas, they would fail it.

    Raises:
      UserError: the metric cannot be remade from its config (a custom metric whose
        `get_config` does not return its `__init__` arguments), or its variables' shape
        cannot be known.
    """
    try:
        copy = type(metric).from_config(metric.get_config())
    except (TypeError, ValueError, NotImplementedError) as error:
        raise UserError(
            f"metric {metric.name!r} ({type(metric).__name__}) cannot be remade from its config "
            f"({type(error).__name__}: {one_line(error, 120)}); give it a get_config() returning its __init__ "
            "arguments (Keras's rule for custom metrics): the engine makes a fresh copy in the strategy's scope"
        ) from None
    if compat.metric_unbuilt(copy):
        shape = _output_shape(model)
        if shape is not None:
            compat.build_metric(copy, shape, shape)
        elif tf.distribute.get_strategy().num_replicas_in_sync > 1:  # One replica makes them as Keras does.
            raise UserError(
                f"metric {metric.name!r} ({type(metric).__name__}) makes its variables on its first update, "
                "which cannot happen inside a step on several replicas, and the model output shape is unknown; "
                "pass a built keras.Model, or a metric that takes its size up front (e.g. AUC(num_labels=...))"
            )
    return copy


def _output_shape(model: Any) -> tuple[int | None, ...] | None:
    """The shape of a built Keras model's (only) output; None where it cannot be told."""
    outputs = getattr(model, "outputs", None) if isinstance(model, keras.Model) else None
    try:
        if outputs and len(outputs) == 1:
            return tuple(outputs[0].shape)
    except (AttributeError, ValueError):
        pass
    return None


_LIVE_TRAIN_RUNNERS: weakref.WeakSet[TrainRunner] = weakref.WeakSet()


def _leave_training_iterators_at_exit() -> None:
    """The exit handler: the training iterators that Trainers still hold (a research script's
    Trainers, never closed) are left unfreed (`iterator_release.leave_unfreed`), not freed one
    by one by the interpreter's finalization."""
    for runner in list(_LIVE_TRAIN_RUNNERS):
        runner.leave_iterator_unfreed()


atexit.register(_leave_training_iterators_at_exit)  # After iterator_release's: it runs first.
