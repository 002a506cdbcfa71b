"""The Trainer's arguments checked on their own and together, and the model's state made
ready (checked in scope, optimizers built), before anything is traced or written.

Apart from the outer loop (`engine.trainer.trainer`) so that it reads as the loop alone; the
checkpoint evaluator shares `prepare_model_state`. Every problem is one `UserError` naming
the argument and what to pass instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import keras
import tensorflow as tf

from engine.compat import is_sharded_variable
from engine.data import Data, DataForm, as_eval_form, as_train_form
from engine.errors import UserError
from engine.logger import logger
from engine.loop.steps import ReplicaStep
from engine.losses import LossFn
from engine.options import StepOptions
from engine.resident import ResidentData, ResidentEvalData, keeps_on_devices
from engine.variables import check_regularizers_visible, require_trainable_variables

Optimizers: TypeAlias = keras.optimizers.Optimizer | Mapping[str, keras.optimizers.Optimizer]


def prepare_model_state(
    strategy: tf.distribute.Strategy, model: Any, optimizers: Mapping[str, keras.optimizers.Optimizer]
) -> tf.Variable:
    """Checks the model and builds its optimizers in the strategy's scope; returns a new global step.

    What a checkpoint of this model holds must exist before it is restored:
    Keras 3 optimizers create their slots (and moving averages) when built,
    which must also happen before the first traced step. Shared by the
    Trainer and the checkpoint evaluator, which restores without training.
    """
    with strategy.scope():
        variables = require_trainable_variables(model)
        check_no_sharded_keras_variables(variables)
        check_regularizers_visible(model)
        check_created_in_scope(strategy, variables, "the model's variables were")
        for name, optimizer in optimizers.items():
            check_created_in_scope(
                strategy, [optimizer.iterations], f"optimizer {name!r} ({type(optimizer).__name__}) was"
            )
        build_optimizers(optimizers, model, variables)
        return tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="global_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )


def check_no_sharded_keras_variables(variables: Sequence[Any]) -> None:
    """Refuses a Keras 3 variable that a `variable_partitioner` split: Keras cannot train one (its
    gradient fails deep in the first step: 'ShardedVariable' object has no attribute 'handle')."""
    for variable in variables:
        if isinstance(variable, keras.Variable) and is_sharded_variable(variable.value):
            raise UserError(
                f"Keras variable {variable.path!r} was split by the strategy's variable_partitioner, and "
                "Keras 3 cannot train a split variable: make the ParameterServerStrategy without one and "
                "build large tables as engine.ShardedEmbedding (the partitioner serves tf.Module models)"
            )


def check_arguments(
    strategy: tf.distribute.Strategy,
    loss_fn: LossFn | None,
    step_fn: ReplicaStep | None,
    metrics: Sequence[Any],
    weighted_metrics: Sequence[Any],
    eval_data: Data | None,
    global_batch_size: int,
    step_options: StepOptions,
    *,
    loss_from_model: bool = False,
    evaluates_itself: bool = False,
) -> None:
    """The Trainer's arguments on their own and together, before anything is built.

    `loss_from_model`: the model's own `compute_loss` is a loss; `evaluates_itself`: its own
    `test_step` evaluates it (`engine.keras_model`)."""
    if loss_fn is None and step_fn is None and not loss_from_model:
        raise UserError("pass loss_fn, step_fn or both to Trainer (or compile() the model with a loss)")
    check_metric_names(metrics, weighted_metrics)
    if isinstance(eval_data, ResidentData):
        raise UserError(
            "eval_data cannot be ResidentData, an endless shuffled training stream: pass the eval split "
            "as engine.ResidentEvalData, a tf.data.Dataset of global batches (every example once) or "
            "fn(input_context)"
        )
    if eval_data is not None and loss_fn is None and not evaluates_itself:
        raise UserError("evaluation needs loss_fn (per-example losses) besides step_fn")
    check_batch(global_batch_size, strategy.num_replicas_in_sync, step_options.grad_accum_steps)
    ignored = step_options.changed()
    if step_fn is not None and ignored:  # A step_fn replaces the step these options shape.
        raise UserError(
            f"step_fn cannot honour {', '.join(ignored)}: those options shape the standard step; "
            "do it in your step_fn, or drop step_fn and pass loss_fn"
        )


def train_data_form(
    strategy: tf.distribute.Strategy, data: Data, global_batch_size: int
) -> DataForm | ResidentData:
    """The declared form the train runner reads: `ResidentData` kept on the devices where the
    strategy allows it, else a tf.data form (ResidentData's `host_data` on the others)."""
    if isinstance(data, ResidentData):
        _check_made_for(data, "train_data", global_batch_size)
        host_form = as_train_form(data.host_data)  # Checked all the same.
        check_dataset_batch(host_form, global_batch_size)
        if keeps_on_devices(strategy):
            return data
        logger.info("%s trains from ResidentData.host_data (tf.data)", type(strategy).__name__)
        return host_form
    form = as_train_form(data)
    check_dataset_batch(form, global_batch_size)
    return form


def eval_data_form(
    strategy: tf.distribute.Strategy, data: Data, global_batch_size: int
) -> DataForm | ResidentEvalData:
    """The form the eval runner reads: `ResidentEvalData` kept on the devices where the strategy
    allows it, else a tf.data form (its `host_data` on the others)."""
    if not isinstance(data, ResidentEvalData):
        return as_eval_form(data)
    _check_made_for(data, "eval_data", global_batch_size)
    host_form = as_eval_form(data.host_data)  # Checked all the same.
    if keeps_on_devices(strategy):
        return data
    logger.info("%s evaluates from ResidentEvalData.host_data (tf.data)", type(strategy).__name__)
    return host_form


def _check_made_for(data: ResidentData | ResidentEvalData, argument: str, global_batch_size: int) -> None:
    if data.global_batch_size not in (None, global_batch_size):
        raise UserError(
            f"`{argument}` ({type(data).__name__}) was made for `global_batch_size={data.global_batch_size}` "
            f"but the Trainer has `global_batch_size={global_batch_size}`; make both the same"
        )


def check_metric_names(metrics: Sequence[Any], weighted_metrics: Sequence[Any]) -> None:
    names = [str(getattr(m, "name", "")) for m in (*metrics, *weighted_metrics)]
    for metric in (*metrics, *weighted_metrics):
        if not isinstance(metric, keras.metrics.Metric):
            raise UserError(f"metrics take keras.metrics.Metric objects, got {type(metric).__name__}")
    clashes = sorted(
        {n for n in names if names.count(n) > 1} | {n for n in names if n in ("loss", "num_examples")}
    )
    if clashes:
        raise UserError(
            f"metric name(s) {', '.join(map(repr, clashes))} used twice (or taken by the loss or the example "
            "count); give each metric its own name=, e.g. name='weighted_accuracy'"
        )


def check_batch(global_batch_size: int, num_replicas: int, grad_accum_steps: int) -> None:
    if global_batch_size < 1:
        raise UserError(f"global batch size {global_batch_size} must be positive")
    if global_batch_size % (num_replicas * grad_accum_steps):
        raise UserError(
            f"global batch size {global_batch_size} is not divisible by "
            f"{num_replicas} replica(s) x {grad_accum_steps} accumulation step(s); "
            f"use a multiple of {num_replicas * grad_accum_steps}"
        )


def named_optimizers(optimizer: Optimizers) -> dict[str, keras.optimizers.Optimizer]:
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return {"optimizer": optimizer}
    if (
        isinstance(optimizer, Mapping)
        and optimizer
        and all(isinstance(o, keras.optimizers.Optimizer) for o in optimizer.values())
    ):
        return dict(optimizer)
    raise UserError(
        f"optimizer={optimizer!r} must be a Keras optimizer or a non-empty dict of name -> Keras optimizer"
    )


def build_optimizers(optimizers: Mapping[str, keras.optimizers.Optimizer], model: Any, variables: list) -> None:
    """Builds each unbuilt optimizer on the variables it will update.

    One optimizer updates the whole model. A named one (several) updates
    `getattr(model, name)`; where the model has no such part the engine
    cannot know its variables and says how to build it.
    """
    single = len(optimizers) == 1
    for name, optimizer in optimizers.items():
        if optimizer.built:
            continue
        if single:
            optimizer.build(variables)
            continue
        part = getattr(model, name, None)
        if part is None:
            raise UserError(
                f"optimizer {name!r} is not built and the model ({type(model).__name__}) has no "
                f"attribute {name!r} to build it for: name it after the sub-model it trains, or call "
                f"optimizer.build(<its variables>) inside strategy.scope() before creating the Trainer"
            )
        optimizer.build(require_trainable_variables(part))


def check_dataset_batch(form: DataForm, global_batch_size: int) -> None:
    """A Dataset of global batches whose batch dimension is static is checked here, at once."""
    dataset = getattr(form, "dataset", None)
    if dataset is None:
        return
    leaves = tf.nest.flatten(dataset.element_spec)
    size = leaves[0].shape[0] if leaves and leaves[0].shape.rank else None
    if size is not None and size != global_batch_size:
        raise UserError(
            f"`train_data` yields batches of {size} examples but `global_batch_size={global_batch_size}`; "
            f"batch the dataset (global batches) by {global_batch_size} or pass `global_batch_size={size}`"
        )


def check_created_in_scope(strategy: tf.distribute.Strategy, variables: list, what: str) -> None:
    for variable in variables[:1]:
        if isinstance(variable, keras.Variable):
            variable = variable.value  # The tf.Variable inside a Keras variable.
        if not strategy.extended.variable_created_in_scope(variable):
            raise UserError(
                f"{what} created outside strategy.scope(); "
                "build the model and optimizer inside `with strategy.scope():`"
            )
