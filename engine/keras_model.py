"""What a Keras user hands over besides the layers, honoured as `fit`, `evaluate` and `predict` honour it.

A `keras.Model` subclass may override `train_step`, `test_step`, `predict_step` or
`compute_loss`; Keras runs those as the step. So does the engine, inside its own compiled
loops (many steps a call, checkpoints, summaries, resume around them):

- an overridden `train_step` is the per-replica training step (`KerasTrainStep`). It
  returns its metrics' running results, as in `fit`; the engine resets the model's metrics
  at the start of every compiled call and logs what the call's last step returned.
- an overridden `test_step` is the evaluation step (`KerasEvalRunner`): the evaluation's
  logs are what its last batch returned, the model's metrics reset before each pass, as
  `evaluate` does.
- an overridden `predict_step` gives `predict()`'s rows.
- an overridden `compute_loss` is the standard step's loss: what it adds to Keras's own
  loss (`compute_loss` of `keras.Model` on the same batch) counts once per global step, as
  a regularization loss does, so 1 and N replicas train alike (`loss_beyond_keras`). Keras
  `fit` counts such a term once per replica; on one replica both are the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from engine import compat
from engine.compat import engine_graph_code, user_code
from engine.data import DataForm, distribute_eval_data, element_spec
from engine.errors import UserError
from engine.loop.iterator_release import release_in_background
from engine.loop.steps import examples_in_batch
from engine.losses import describe_structure
from engine.metric_values import log_scalars
from engine.resident import ResidentData

# The methods of `keras.Model` that make a step; a subclass that overrides one changes the step.
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")


def overridden(model: Any, method: str) -> bool:
    """Whether `model` is a Keras model whose class overrides `keras.Model.<method>`."""
    if not isinstance(model, keras.Model):
        return False
    return getattr(type(model), method, None) is not getattr(keras.Model, method)


def overrides(model: Any) -> tuple[str, ...]:
    """The step methods `model`'s class overrides, in `STEP_METHODS`'s order."""
    return tuple(method for method in STEP_METHODS if overridden(model, method))


def flat_logs(outputs: Any, what: str) -> dict[str, tf.Tensor]:
    """A Keras step's returned logs as one level of scalars: nested dicts (a `CompileMetrics`
    result, as `{m.name: m.result() for m in self.metrics}` returns it) are flattened into
    their keys, as Keras's `get_metrics_result` does; a vector (a metric with one value per
    class) becomes one entry per element, `name/0`, `name/1`, ...."""
    if outputs is None:
        return {}
    if not isinstance(outputs, Mapping):
        raise UserError(
            f"the model's {what} returned a {type(outputs).__name__}; return a dict of logs "
            "(e.g. {m.name: m.result() for m in self.metrics}), as Keras fit requires"
        )
    logs: dict[str, tf.Tensor] = {}
    for name, value in outputs.items():
        if isinstance(value, Mapping):
            logs.update(flat_logs(value, what))
            continue
        value = tf.convert_to_tensor(value)
        if value.shape.rank == 0:
            logs[str(name)] = value
        elif value.shape.num_elements() == 1:
            logs[str(name)] = tf.reshape(value, [])
        elif value.shape.is_fully_defined():
            for index, element in enumerate(tf.unstack(tf.reshape(value, [-1]))):
                logs[f"{name}/{index}"] = element
        else:
            raise UserError(
                f"the model's {what} returned {name!r} of shape {value.shape.as_list()}: return scalars "
                "(or vectors of a fixed size)"
            )
    return logs


def metrics_result_or_logs(model: keras.Model, logs: dict[str, float]) -> dict[str, float]:
    """The model's metrics read once on the host where the step's logs are exactly their results
    (the same names), else the logs: what `fit` and `evaluate` report at the end of an epoch.
    A result read inside a replica's step is that replica's view of a variable other replicas
    are still adding to; the host's read is every replica's sum."""
    results: dict[str, float] = {}
    for name, value in model.get_metrics_result().items():
        results.update(log_scalars(name, value))
    return results if set(results) == set(logs) else logs


class KerasTrainStep:
    """The model's own `train_step` as the engine's per-replica step.

    Its outputs are running results (the model's metrics since they were reset), so the
    compiled loop keeps the last step's values instead of averaging the steps
    (`running_values`), and `start_loop` resets the metrics before each call.
    """

    running_values = True

    def __init__(self, model: keras.Model):
        self.model = model

    def __call__(self, batch: Any) -> dict[str, tf.Tensor]:
        return flat_logs(user_code(self.model.train_step)(batch), "train_step")

    def start_loop(self) -> None:
        self.model.reset_metrics()


def make_keras_eval_loop(strategy: tf.distribute.Strategy, model: keras.Model) -> Callable[..., Any]:
    """`loop(iterator, max_batches) -> (exhausted, batches_run, examples, logs)`: the model's
    `test_step` over at most `max_batches` more batches; `logs` are what the last of them
    returned (averaged over replicas, as `evaluate` reduces them), zeros where none ran."""
    names: list[str] = []

    @engine_graph_code
    def replica_step(batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
        logs = flat_logs(user_code(model.test_step)(batch), "test_step")
        if not names:
            names.extend(logs)
        values = [tf.cast(logs[name], tf.float32) for name in names]
        return tf.stack(values or [tf.constant(0.0)]), examples_in_batch(batch)

    @engine_graph_code
    def one_batch(batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
        values, examples = strategy.run(replica_step, args=(batch,))
        values = strategy.reduce(tf.distribute.ReduceOp.MEAN, values, axis=None)
        return values, strategy.reduce(tf.distribute.ReduceOp.SUM, examples, axis=None)

    @tf.function
    def eval_loop(iterator: Any, max_batches: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        first = iterator.get_next_as_optional()

        def run_batches() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
            last, examples = one_batch(first.get_value())
            exhausted, batches = tf.constant(False), tf.constant(1)
            for _ in tf.range(max_batches - 1):
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    exhausted = tf.constant(True)
                    break
                last, more = one_batch(optional.get_value())
                examples += more
                batches += 1
            return exhausted, batches, examples, last

        def no_batch() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
            # tf.cond traces run_batches first: the step's names are known here.
            return tf.constant(True), tf.constant(0), tf.constant(0.0), tf.zeros([max(len(names), 1)])

        return tf.cond(first.has_value(), run_batches, no_batch)

    eval_loop.names = names  # type: ignore[attr-defined]
    return eval_loop


class KerasEvalRunner:
    """Evaluation by the model's own `test_step`, as `evaluate` runs it: the model's metrics
    reset, every batch once, the logs its last batch returned, plus `num_examples`."""

    def __init__(
        self, strategy: tf.distribute.Strategy, model: keras.Model, data: DataForm, *, batches_per_call: int
    ):
        self.strategy = strategy
        self.model = model
        self.data = data
        self.batches_per_call = batches_per_call
        self.metrics: list[Any] = []  # The logs are the step's own; no engine metric.
        self.loop = make_keras_eval_loop(strategy, model)
        self.names: list[str] = self.loop.names  # type: ignore[attr-defined]  # Filled by the first trace.

    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        self.model.reset_metrics()
        iterators = [iter(distribute_eval_data(self.strategy, self.data))]
        names = self.names
        last: tf.Tensor | None = None
        examples = 0.0
        try:
            batches = tf.constant(self.batches_per_call, tf.int32)
            while True:
                exhausted, ran, seen, values = self.loop(iterators[0], batches)
                if int(ran):
                    last, examples = values, examples + float(seen)
                if bool(exhausted):
                    break
                if stop_requested():
                    return None
        finally:
            release_in_background(iterators)
        if last is None:
            raise UserError("eval_data holds no batch: evaluation needs at least one example")
        logs = {name: float(value) for name, value in zip(names, last.numpy(), strict=False)}
        logs = metrics_result_or_logs(self.model, logs)
        logs["num_examples"] = int(round(examples))
        return logs


def keras_predict_outputs(model: keras.Model, batch: Any) -> Any:
    """The model's own `predict_step` on a replica's batch (`(features,)` or `(features,
    labels[, weights])`, as Keras's predict hands it over)."""
    return user_code(model.predict_step)(batch)


def _call_compute_loss(method: Callable[..., Any], x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """`compute_loss` as Keras calls it: with `training=True` where the method takes it (Keras 3.3+)."""
    if "training" in inspect.signature(method).parameters:
        return method(x, y, y_pred, sample_weight, training=True)
    return method(x, y, y_pred, sample_weight)


def loss_beyond_keras(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
    """What the model's own `compute_loss` adds to Keras's (`keras.Model.compute_loss`) on this
    replica's batch: a penalty, an auxiliary term. The standard step adds it divided by the
    number of replicas (counted once per global step, as the engine counts regularization
    losses), the rest of the loss being the engine's own mean over the global batch."""
    own = tf.cast(user_code(_call_compute_loss)(model.compute_loss, x, y, y_pred, sample_weight), tf.float32)
    if compat.compile_loss(model) is None and not model.losses:
        return own  # Keras's own would refuse: there is no loss but the model's.
    base = _call_compute_loss(
        lambda *args, **kwargs: keras.Model.compute_loss(model, *args, **kwargs), x, y, y_pred, sample_weight
    )
    return own - tf.cast(base, tf.float32)


def per_element_loss(loss: Any, y_true: Any = None, y_pred: Any = None) -> Any:
    """A loss as `compile(loss=)` takes it (a name, a function, a `keras.losses.Loss`) in the
    per-element form the engine averages over the global batch itself: a Loss object with the
    default reduction becomes the same loss with `reduction=None`; Keras's loss functions
    already return one value per example. `y_true` / `y_pred` (anything with a `.shape`) let
    "crossentropy" be resolved as Keras resolves it."""
    if isinstance(loss, str):
        if loss.lower() in ("crossentropy", "ce") and (y_true is None or y_pred is None):
            raise UserError(
                f"loss={loss!r} is resolved from the labels' and outputs' shapes, which are unknown here; "
                "name the loss (e.g. 'sparse_categorical_crossentropy')"
            )
        try:
            loss = compat.keras_loss(loss, y_true, y_pred)
        except ValueError as error:
            raise UserError(f"loss={loss!r} is not a Keras loss ({error})") from None
        return getattr(loss, "fn", loss)  # Keras wraps a named function; the function is per example.
    if isinstance(loss, keras.losses.Loss) and loss.reduction not in (None, "none"):
        config = loss.get_config()
        config["reduction"] = None
        try:
            return type(loss).from_config(config)
        except (TypeError, ValueError) as error:
            raise UserError(
                f"loss {type(loss).__name__} reduces its batch (reduction={loss.reduction!r}) and cannot be "
                f"remade with reduction=None from its config ({error}); pass it with reduction=None"
            ) from None
    return loss


def resolve_metrics(metrics: Any, y_true: Any, y_pred: Any, *, argument: str) -> list[keras.metrics.Metric]:
    """Metrics as `compile(metrics=)` takes them: objects, names ("accuracy", "mae", "auc"),
    functions, resolved against the labels' and outputs' shapes as Keras resolves them."""
    if metrics is None:
        return []
    if isinstance(metrics, Mapping) or (
        isinstance(metrics, (list, tuple)) and any(isinstance(m, (list, tuple, Mapping)) for m in metrics)
    ):
        raise UserError(
            f"{argument} nested per output ({describe_structure(metrics)}) is not taken yet: pass the Trainer "
            "a flat list of metric objects, each reading the outputs it needs"
        )
    resolved = []
    for metric in metrics if isinstance(metrics, (list, tuple)) else [metrics]:
        if isinstance(metric, keras.metrics.Metric):
            resolved.append(metric)
            continue
        if str(metric).lower() in ("accuracy", "acc") and (y_true is None or y_pred is None):
            raise UserError(
                f"{argument} {metric!r} is resolved from the labels' and outputs' shapes, which are unknown "
                "for this data form or model; pass the metric object (e.g. SparseCategoricalAccuracy())"
            )
        try:
            resolved.append(compat.keras_metric(metric, y_true, y_pred))
        except (ValueError, TypeError) as error:
            raise UserError(f"{argument} {metric!r} is not a Keras metric ({error})") from None
    return resolved


@dataclass(frozen=True)
class KerasArguments:
    """The Trainer's arguments once the model's own settings are taken in: what `compile()`
    set where the Trainer was given nothing, and the overridden step methods."""

    optimizer: Any
    loss_fn: Any
    loss_weights: Any
    metrics: Sequence[Any]
    weighted_metrics: Sequence[Any]
    step_fn: Any
    own_train_step: bool  # The model's train_step is the step (`KerasTrainStep`).
    own_test_step: bool  # The model's test_step evaluates (`KerasEvalRunner`).
    own_predict_step: bool
    own_compute_loss: bool  # The standard step adds `loss_beyond_keras`.

    @property
    def uses_compiled_state(self) -> bool:
        """Whether Keras's own step code runs (and updates the compiled metrics and loss)."""
        return self.own_train_step or self.own_test_step or self.own_compute_loss


def _refuse_both(what: str, trainer_argument: str) -> UserError:
    return UserError(
        f"the model was compiled with {what} and the Trainer was given {trainer_argument} too: pass one "
        f"(with {trainer_argument} left out the Trainer takes the compiled one)"
    )


def keras_arguments(
    model: Any,
    *,
    strategy: tf.distribute.Strategy,
    optimizer: Any,
    loss_fn: Any,
    loss_weights: Any,
    metrics: Sequence[Any],
    weighted_metrics: Sequence[Any],
    step_fn: Any,
    eval_step_fn: Any,
    shapes: Callable[[], tuple[Any, Any]],
) -> KerasArguments:
    """Takes in what a Keras model carries, as `fit` would, or refuses a conflict in one line.

    `shapes()` gives the labels' and outputs' shapes (objects with `.shape`, or None where
    unknown), asked only where a name ("accuracy", "crossentropy") needs them.
    """
    compiled = compat.compile_arguments(model)
    own = set(overrides(model))
    _check_own_steps(model, own, strategy, compiled, step_fn=step_fn, eval_step_fn=eval_step_fn, loss_fn=loss_fn)
    optimizer = _optimizer_of(model, own, compiled, optimizer)
    needs_shapes = any(
        isinstance(item, str)
        for item in tf.nest.flatten([compiled.get("loss"), compiled.get("metrics"), list(metrics)])
    )
    y_true, y_pred = shapes() if needs_shapes else (None, None)
    loss_fn, loss_weights = _losses_of(compiled, loss_fn, loss_weights, y_true, y_pred)
    for argument, given in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
        if compiled.get(argument) is not None and given:
            raise _refuse_both(f"{argument}=", argument)
    own_train_step = "train_step" in own
    return KerasArguments(
        optimizer=optimizer,
        loss_fn=loss_fn,
        loss_weights=loss_weights,
        metrics=resolve_metrics(metrics or compiled.get("metrics"), y_true, y_pred, argument="metrics"),
        weighted_metrics=resolve_metrics(
            weighted_metrics or compiled.get("weighted_metrics"), y_true, y_pred, argument="weighted_metrics"
        ),
        step_fn=KerasTrainStep(model) if own_train_step else step_fn,
        own_train_step=own_train_step,
        own_test_step="test_step" in own,
        own_predict_step="predict_step" in own,
        own_compute_loss="compute_loss" in own,
    )


def _check_own_steps(
    model: Any,
    own: set[str],
    strategy: tf.distribute.Strategy,
    compiled: Mapping[str, Any],
    *,
    step_fn: Any,
    eval_step_fn: Any,
    loss_fn: Any,
) -> None:
    """Refuses what cannot go with the model's own step methods, naming both."""
    name = type(model).__name__
    steps = sorted(own - {"compute_loss"})
    if steps and isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise UserError(
            f"{name} overrides {', '.join(steps)}, which the engine runs as Keras does, on replicas it "
            "drives itself: a parameter-server coordinator schedules the engine's steps only; pass loss_fn "
            "(or step_fn), or train with another strategy"
        )
    conflicts = (
        ("train_step", step_fn, "which is its step; drop step_fn (or the override)"),
        ("test_step", eval_step_fn, "which evaluates it; drop eval_step_fn or the override"),
        (
            "compute_loss",
            loss_fn,
            "which is its loss: drop loss_fn and compile the model with the loss its compute_loss builds on "
            "(if any)",
        ),
    )
    for method, given, what in conflicts:
        if method in own and given is not None:
            raise UserError(f"{name} overrides {method}, {what}")
    if steps and not compiled:
        raise UserError(
            f"{name} overrides {', '.join(steps)}, which run as Keras runs them, on what compile() sets up "
            "(self.optimizer, self.compute_loss, self.metrics): compile() it first, as fit and evaluate require"
        )


def _optimizer_of(model: Any, own: set[str], compiled: Mapping[str, Any], optimizer: Any) -> Any:
    """The Trainer's optimizer, else the compiled one; the model's own train_step applies only its own."""
    model_optimizer = getattr(model, "optimizer", None) if compiled else None
    if optimizer is None:
        if model_optimizer is None:
            raise UserError("pass optimizer= to the Trainer, or compile() the model with one")
        return model_optimizer
    if "train_step" in own and model_optimizer is not None and optimizer is not model_optimizer:
        raise UserError(
            f"{type(model).__name__}.train_step applies self.optimizer ({type(model_optimizer).__name__}), "
            f"not the Trainer's optimizer ({type(optimizer).__name__}): pass optimizer=None or the model's"
        )
    return optimizer


def _losses_of(compiled: Mapping[str, Any], loss_fn: Any, loss_weights: Any, y_true: Any, y_pred: Any) -> tuple:
    """`(loss_fn, loss_weights)`: the compiled ones where the Trainer has none, each loss per element."""
    compiled_loss = compiled.get("loss")
    if compiled_loss is None:
        if loss_fn is None:
            return None, loss_weights
        return tf.nest.map_structure(lambda loss: per_element_loss(loss, y_true, y_pred), loss_fn), loss_weights
    if loss_fn is not None:
        raise _refuse_both("loss=", "loss_fn")
    if loss_weights is not None:
        raise _refuse_both("a loss", "loss_weights")
    per_element = tf.nest.map_structure(lambda loss: per_element_loss(loss, y_true, y_pred), compiled_loss)
    return per_element, compiled.get("loss_weights")


def label_and_output_shapes(
    strategy: tf.distribute.Strategy, model: Any, train_form: DataForm | ResidentData
) -> tuple[Any, Any]:
    """The labels' spec (from a dataset's element_spec or arrays) and the model's output (a
    functional model's symbolic output, else the model called on one row of zeros), for
    resolving names as `compile` resolves them; None for what cannot be told."""
    spec = batch_spec(strategy, train_form)
    if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
        return None, None
    labels = tf.nest.flatten(spec[1])
    y_true = labels[0] if len(labels) == 1 else None
    outputs = getattr(model, "outputs", None) if compat.is_functional(model) else None
    if outputs:
        return y_true, outputs[0] if len(outputs) == 1 else None
    try:
        zeros = tf.nest.map_structure(lambda s: tf.zeros([1, *s.shape[1:]], s.dtype), spec[0])
        produced = tf.nest.flatten(model(zeros, training=False))
    except Exception:  # noqa: BLE001 - the shape is a convenience: unknown means "name the metric".
        return y_true, None
    return y_true, produced[0] if len(produced) == 1 else None


def batch_spec(strategy: tf.distribute.Strategy, train_form: DataForm | ResidentData) -> Any:
    """The spec of one training batch: resident arrays' shapes, or the form's element spec (a
    function form's pipeline is built once for it: `engine.data.element_spec`)."""
    if isinstance(train_form, ResidentData):
        return tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), train_form.tensors)
    return element_spec(strategy, train_form)


def build_compiled_state(
    strategy: tf.distribute.Strategy, model: Any, train_form: DataForm | ResidentData
) -> None:
    """A compiled model's metrics and loss state made in the strategy's scope before the first
    trace, as `fit` makes them (its own train_step, test_step and compute_loss update them)."""
    if not compat.compile_arguments(model):
        return
    spec = batch_spec(strategy, train_form)
    with strategy.scope():
        compat.build_compiled_state(model, spec)
