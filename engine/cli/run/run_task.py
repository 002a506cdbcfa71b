"""The problem a command-line run trains: `--task=package.module:function`, or the
`engine.Task` the flags make (`--model`, `--dataset`, `--loss`, `--metrics`).

Resolved once, and identically, by the training job, the checkpoint evaluator
and predict, so that `--mode=eval` reports the numbers the evaluation inside
training reports. Order matters: the loss says how the labels are read (a
regression loss reads integer labels as values), the data then say the input
shape, the label kind and the output size, and only then is the model built.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras

from engine import objectives
from engine.cli.config.settings.sections import DecisionSettings, ProblemSettings
from engine.cli.process.own_packages import own_package  # The engine's, beside a user's models.py/input.py.
from engine.cli.run.table_shards import ShardBudget
from engine.errors import UserError
from engine.layers import default_num_shards
from engine.loop.steps import EvalStep, ReplicaStep
from engine.losses import LossFn, SameLabels
from engine.task import Task
from engine.user_code import UserCodeError, exited, first_line, import_callable, signature_text

# The built-in image sets are served at the model's input shape; every other form at its own.
IMAGE_SETS_AT_MODEL_SHAPE = ("digits", "mnist", "synthetic")


@dataclass(frozen=True)
class RunTask:
    """A task resolved against its data: everything the Trainer and the readers need."""

    model_name: str  # How messages name the model: --model's value, or the task's.
    build: Callable[[tuple[int, ...], int], keras.Model]
    source: Any  # input.DataSource
    loss_name: str  # A Keras name, or the user's function's name.
    loss_fn: LossFn
    num_outputs: int
    metric_names: tuple[str, ...]
    _metrics: Callable[[], list[keras.metrics.Metric]] = field(repr=False)
    step_fn: ReplicaStep | None = None
    eval_step_fn: EvalStep | None = None
    # A CSV's feature columns, by name, in the order the model takes them (None: not a CSV).
    feature_columns: tuple[str, ...] | None = None
    loss_weights: Any = None  # The Task's, for a loss nested like several outputs.
    # --normalize=standardize on a CSV: the model standardizes its columns (models.standardized).
    standardizes: bool = False
    # --ps_shards: the shards of each ShardedEmbedding the builder makes without a count of its own.
    ps_shards: int | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.source.feature_shape)

    @property
    def reported(self) -> tuple[str, ...]:
        """The eval metrics a run reports: what --best_checkpoint_metric and the others may name."""
        return ("loss", *self.metric_names)

    def trainer_arguments(self, model: Any = None) -> dict[str, Any]:
        """`loss_fn`, `metrics` (new objects each call) and any custom steps, as the Trainer takes
        them. A `model` of several outputs (an auxiliary head) trains each against the labels
        with the loss a name chose (`engine.losses.SameLabels`); the metrics measure the first."""
        loss_fn: Any = self.loss_fn
        heads = _heads(model)
        if heads > 1 and isinstance(loss_fn, objectives.PerExampleLoss):
            loss_fn = SameLabels(loss_fn, heads)
        arguments: dict[str, Any] = {"loss_fn": loss_fn, "metrics": self._metrics()}
        if self.loss_weights is not None:
            arguments["loss_weights"] = self.loss_weights
        if self.step_fn is not None:
            arguments["step_fn"] = self.step_fn
        if self.eval_step_fn is not None:
            arguments["eval_step_fn"] = self.eval_step_fn
        return arguments

    def build_model(self) -> keras.Model:
        """The model at the data's shape, checked against the data before anything is written;
        call it in the strategy's scope."""
        models = own_package("models")
        try:
            try:
                with default_num_shards(self.ps_shards, ShardBudget() if self.ps_shards else None):
                    model = self.build(self.input_shape, self.num_outputs)
            except SystemExit as error:  # It ended nothing: the run ends with one line instead.
                named = self.model_name if self.model_name.startswith("--") else f"--model={self.model_name}"
                raise UserError(f"{named} {exited(error, 'a keras.Model')}") from None
            except (ValueError, TypeError) as error:  # What Keras raises for layers that cannot take the shape.
                hint = "; --model=mlp takes any shape" if len(self.input_shape) != 3 else ""
                raise UserError(
                    f"--model={self.model_name} cannot take the data's examples of shape "
                    f"{(None, *self.input_shape)}: {type(error).__name__}: {first_line(error)}{hint}"
                ) from None
            element_shape = self.source.labels.shape if self.source.labels.kind == objectives.CLASSES else ()
            models.check_fits_data(self.model_name, model, self.input_shape, self.num_outputs, element_shape)
        except models.ModelError as error:  # A user's builder returned something unusable.
            raise UserError(str(error)) from None
        if self.standardizes:
            model = self._standardized(model, models)
        return model

    def _standardized(self, model: keras.Model, models: Any) -> keras.Model:
        """`model` standardizing its columns and, for a regression of one output, scaling that
        output to the labels; the statistics from the train split where the source holds it (a
        model rebuilt for predict gets them from the checkpoint it restores)."""
        outputs_too = self.source.labels.kind == objectives.VALUES and _heads(model) == 1
        wrapped = models.standardized(model, self.input_shape, outputs_too=outputs_too)
        if hasattr(self.source, "train_arrays"):
            features, labels = self.source.train_arrays()
            models.set_table_statistics(wrapped, features, labels if outputs_too else None)
        return wrapped

    def describe(self) -> str:
        labels = self.source.labels.describe()
        return f"loss={self.loss_name} metrics={','.join(self.metric_names) or 'none'} labels={labels}"


def _heads(model: Any) -> int:
    """How many outputs a Keras model returns (1 where it cannot be told: a subclassed model)."""
    try:
        return max(1, len(keras.tree.flatten(model.outputs))) if isinstance(model, keras.Model) else 1
    except (AttributeError, ValueError):  # No symbolic outputs.
        return 1


def user_task(problem: ProblemSettings) -> Task:
    """The `engine.Task` of --task (called with the config's task_params), else an empty one."""
    if not problem.task:
        return Task()
    try:
        function, where = import_callable(problem.task, setting="task")
    except UserCodeError as error:
        raise UserError(str(error)) from None
    params = dict(problem.task_params)
    try:
        inspect.signature(function).bind(**params)
    except TypeError:
        raise UserError(
            f"--task={problem.task}: {function.__name__}{signature_text(function)} ({where}) cannot take the "
            f"task_params {sorted(params)}; give the function those keyword parameters"
        ) from None
    except ValueError:  # No signature to inspect.
        pass
    try:
        task = function(**params)
    except SystemExit as error:  # It ended nothing: the run ends with one line instead.
        raise UserError(f"--task={problem.task} ({where}) {exited(error, 'an engine.Task')}") from None
    except UserError:
        raise
    except Exception as error:  # Whatever the user's function raises.
        raise UserError(
            f"--task={problem.task} ({where}) raised {type(error).__name__}: {first_line(error)}"
        ) from None
    if not isinstance(task, Task):
        raise UserError(
            f"--task={problem.task} ({where}) returned {type(task).__name__}, not an engine.Task; "
            "return engine.Task(model=..., data=..., loss=..., metrics=...)"
        )
    return task


def resolve_task(problem: ProblemSettings, *, source: Any = None) -> RunTask:
    """The run's task, its data loaded (or checked) and its loss and metrics chosen. With a
    `source` (an input.DescribedSource: what the data were, recorded by the training), no data
    are read: predict rebuilds the model from it."""
    task = user_task(problem)
    models = own_package("models")
    loss = task.loss if task.loss is not None else problem.loss
    if task.model is not None:
        model_name, build, default_shape = f"--task={problem.task}'s model", task.model, None
    else:
        try:
            spec = models.get_model_spec(problem.model)
        except models.ModelError as error:
            raise UserError(str(error)) from None
        model_name, build, default_shape = problem.model, spec.build, spec.default_input_shape
        given = {name: getattr(problem, name) for name in spec.keywords if getattr(problem, name) is not None}
        if given:  # --vocab_size for wide_deep: the builder's own keyword.
            build = functools.partial(spec.build, **given)
    feature_columns = None
    if source is None:  # Else described by the training's record: nothing to read.
        wanted_kind = objectives.loss_kind(loss) if isinstance(loss, str) else None
        source, feature_columns = _data_source(problem, task, wanted_kind, default_shape)
    labels = source.labels
    loss_fn, loss_name, num_outputs = _loss(loss, labels, task)
    metric_specs = list(task.metrics if task.metrics is not None else problem.metrics or ())
    if task.metrics is None and problem.metrics is None:
        metric_specs = list(objectives.DEFAULT_METRICS[labels.kind])
    names = tuple(spec if isinstance(spec, str) else spec.name for spec in metric_specs)
    if len(set(names)) != len(names) or "loss" in names:
        raise UserError(
            f"--metrics={','.join(names)} names a metric twice (or `loss`, which is always reported)"
        )

    def metrics() -> list[keras.metrics.Metric]:
        return [
            objectives.build_metric(spec, labels.kind, num_outputs) if isinstance(spec, str) else spec
            for spec in metric_specs
        ]

    metrics()  # Unknown names fail now, before anything is written.
    csv_file = task.data is None and problem.dataset.endswith((".csv", ".parquet"))
    return RunTask(
        model_name=model_name,
        build=build,
        source=source,
        loss_name=loss_name,
        loss_fn=loss_fn,
        num_outputs=num_outputs,
        metric_names=names,
        _metrics=metrics,
        step_fn=task.step_fn,
        eval_step_fn=task.eval_step_fn,
        loss_weights=task.loss_weights,
        feature_columns=feature_columns,
        standardizes=problem.normalize == "standardize" and csv_file,
        ps_shards=problem.ps_shards,
    )


def _data_source(
    problem: ProblemSettings, task: Task, wanted_kind: str | None, default_shape: Any
) -> tuple[Any, tuple[str, ...] | None]:
    """The task's data, else --dataset's, as an input.DataSource; and for a CSV the feature
    columns, what predict reads a CSV's columns by."""
    models, input_lib = own_package("models"), own_package("input")
    options = {
        "num_classes": problem.num_classes,
        "data_dir": problem.data_dir,
        "label_column": problem.label_column,
        "eval_file": problem.eval_file,
        "eval_fraction": problem.eval_fraction,
        "label_kind": wanted_kind,
        "vocab_size": problem.vocab_size,
        "column_types": problem.column_types,
    }
    try:
        if task.data is not None:
            source = input_lib.as_data_source(
                task.data,
                input_lib.DataOptions(**options),
                name=problem.task,
                where=f"--task={problem.task}'s data",
            )
            return source, None
        shape = problem.served_image_shape()
        if shape is None and problem.dataset in IMAGE_SETS_AT_MODEL_SHAPE:
            shape = default_shape or models.USER_MODEL_INPUT_SHAPE
        source = input_lib.get_data_source(problem.dataset, image_shape=shape, **options)
        if getattr(source, "table", None) is not None:  # A table read by its columns' types.
            return source, tuple(source.table.feature_names())
        if not problem.dataset.endswith(".csv"):
            return source, None
        header = input_lib.files.csv_header(problem.dataset)
    except input_lib.DataError as error:
        raise UserError(str(error)) from None
    return source, tuple(name for name in header if name != problem.label_column)


def _loss(loss: Any, labels: Any, task: Task) -> tuple[LossFn, str, int]:
    """The loss function, its name and the outputs the model needs: a named loss (by default
    the labels' own) checked against the labels, or the task's own callable."""
    if loss is None:
        loss = objectives.DEFAULT_LOSSES[labels.kind]
    if not isinstance(loss, str):
        return loss, getattr(loss, "__name__", type(loss).__name__), task.num_outputs or labels.width
    if objectives.loss_kind(loss) != labels.kind:
        raise UserError(
            f"--loss={loss} reads {objectives.loss_kind(loss)} labels but the data's labels are "
            f"{labels.describe()} ({labels.kind}); use a loss for them, e.g. "
            f"--loss={objectives.DEFAULT_LOSSES[labels.kind]}"
        )
    return objectives.PerExampleLoss(loss, labels.width), loss, labels.width


def check_reported(decisions: DecisionSettings, task: RunTask) -> None:
    """The metrics the decision flags name must be ones the run reports (checked before writing)."""
    for name in decisions.METRICS:
        metric = getattr(decisions, name)
        if metric is not None and metric not in task.reported:
            raise UserError(
                f"--{name}={metric} is not an eval metric of this run; it reports: {', '.join(task.reported)}"
            )
