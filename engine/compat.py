"""Every private TensorFlow and Keras API the engine uses, in one place.

Each is a thing the public API does not offer (said at each function), and
each has a fast test in `tests/unit/test_compat.py` that fails naming the TF and
Keras versions when a release moves it, so an upgrade breaks here, in the
fast tier, not somewhere only a slow multi-process test reaches. Code
elsewhere (the engine, `models`, `input`) calls these functions, never the
private names: ruff's SLF001 (private member access) is off for this module
alone, and `keras.src` is imported nowhere else (tests/unit/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

VERSIONS = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"

# The attribute AutoGraph checks before it rewrites an exception raised in converted code into
# one carrying "in user code:" frames (tensorflow/python/autograph/impl/api.py); `UserError`
# sets it so that a refusal found while tracing reaches the user as its one line.
AUTOGRAPH_PASS_THROUGH = "ag_pass_through"


def engine_graph_code(function: Callable) -> Callable:
    """Marks `function` (the engine's own code run while a step is traced) as code AutoGraph
    calls as written: converting it gains nothing (its control flow is TF ops or Python
    over Python values) and cost every process seconds of CPU before the first step
    (benchmarks/RESULTS.md). The caller's AutoGraph status is left as it is, so `strategy.run` inside
    still converts the function it runs, as it would from converted code. The public
    `tf.autograph.experimental.do_not_convert` also turns AutoGraph off for the user code called
    inside; this marker (impl.api.autograph_artifact) does not."""
    from tensorflow.python.autograph.impl import api

    return api.autograph_artifact(function)


def user_code(function: Callable) -> Callable:
    """`function` (a user's model, loss, metric or step) as AutoGraph would call it from
    converted code: converted where it is the user's (a Python `if` on a tensor works), called
    as it is where it is TensorFlow's or Keras's, and left alone where the tracing
    `tf.function` turned AutoGraph off. For the calls from `engine_graph_code`."""
    from tensorflow.python.autograph.impl import api

    call = getattr(type(function), "__call__", None)  # noqa: B004 (the class's, not the object's)
    if api.is_autograph_artifact(function) or api.is_autograph_artifact(call):
        return function  # The engine's own (or an object whose __call__ is engine_graph_code).
    return tf.__internal__.autograph.tf_convert(function, tf.__internal__.autograph.control_status_ctx())


def module_leaves(module: tf.Module, predicate: Callable[[Any], bool]) -> list[Any]:
    """The values under a `tf.Module`'s attributes (lists and dicts of them too) that match
    `predicate`, not descending into a match: the walk `tf.Module.variables` itself makes,
    which is the only one that stops at Keras layers (they answer for their own variables).
    Composites are expanded as that walk does: a `ShardedVariable` (what ParameterServerStrategy's
    `variable_partitioner` makes) yields its shards, the variables that gradients and slots are for."""
    return list(module._flatten(predicate=predicate, expand_composites=True))


def is_sharded_variable(value: Any) -> bool:
    """Whether `value` is a `ShardedVariable`, what ParameterServerStrategy's `variable_partitioner`
    makes of a variable (the class is not public)."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    return isinstance(value, ShardedVariable)


def keras_sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every Keras sublayer of `layer`, recursively: what `Layer.losses` walks (Keras 3 has
    no public recursive listing)."""
    return list(layer._flatten_layers(include_self=False))


def optimizer_variables(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    """The variables an optimizer was built on, in its order: Keras pairs its moving averages
    with them by position (what Keras's own `apply` passes; no public accessor)."""
    return list(optimizer._trainable_variables)


def optimizer_averages(optimizer: keras.optimizers.Optimizer) -> Sequence[Any]:
    """The moving averages of an optimizer built with `use_ema=True` (no public accessor)."""
    return optimizer._model_variables_moving_average


def keras_mask(tensor: Any) -> Any:
    """The mask Keras attached to a layer's output (`Embedding(mask_zero=True)` and the layers
    after it), or None: what Keras's losses and metrics read from `y_pred` (no public accessor)."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor) if tf.is_tensor(tensor) else None


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attaches `mask` to `tensor` as a Keras layer's output carries it, so that Keras metrics
    apply it (outputs the engine concatenates lose theirs; no public setter)."""
    from keras.src.backend.common.masking import set_keras_mask as set_mask

    set_mask(tensor, mask)


def metric_unbuilt(metric: Any) -> bool:
    """Whether a Keras metric still makes its variables on its first `update_state` (R2Score,
    F1Score, FBetaScore, AUC(multi_label=True) without num_labels): Keras's `_built` flag,
    no public one."""
    return getattr(metric, "_built", True) is False and callable(getattr(metric, "_build", None))


def build_metric(metric: Any, y_true_shape: Sequence[int | None], y_pred_shape: Sequence[int | None]) -> None:
    """Makes such a metric's variables now, for batches of these shapes (Keras's `_build`, which
    takes the predictions' shape alone (AUC) or both): made inside a distributed step instead,
    they fail it ("You must feed a value for placeholder tensor")."""
    import inspect

    build = metric._build
    if len(inspect.signature(build).parameters) == 1:
        build(list(y_pred_shape))
    else:
        build(list(y_true_shape), list(y_pred_shape))


def is_functional(model: keras.Model) -> bool:
    """Whether `model` is a graph of layers (`keras.Model(inputs, outputs)`), not a subclass
    with a `call` of its own: Keras's `Functional` class, which is not public."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional) and type(model).call is Functional.call


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """The worker count of a multi-worker or parameter-server strategy (no public count)."""
    return int(strategy.extended._num_workers)


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force (no public getter):
    stateful ops such as `tf.timestamp` then fail at run time."""
    from tensorflow.python.framework import config

    return bool(config.is_op_determinism_enabled())


def num_ps(strategy: tf.distribute.Strategy) -> int:
    """The ps task count of a ParameterServerStrategy: no public count (its `cluster_resolver`
    is None on the coordinator, its `extended.parameter_devices` is not the ps tasks)."""
    return int(strategy.extended._num_ps)


def configure_coordination_service(
    spec: tf.train.ClusterSpec, *, register_timeout_s: float, heartbeat_timeout_s: float = 0.0
) -> bool:
    """Starts the coordination service MultiWorkerMirroredStrategy would start, but with a
    registration timeout (its own waits forever) and a heartbeat timeout (0: TF's 10 s);
    False where one is configured already. TF offers no public way to pass either."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    if context.context().coordination_service is not None:
        return False
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
    )
    return True


def slurm_hostlist_parsers() -> tuple[Callable[[str], list[str]], Callable[[str], list[int]]]:
    """TF's own parsers of Slurm's compact node lists (`node[1-3,5]`) and tasks per node
    (`2(x3),1`): `SlurmClusterResolver` itself cannot be used without GPUs, its parsers can."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist,
        expand_tasks_per_node,
    )

    return expand_hostlist, expand_tasks_per_node


def identity_map() -> dict:
    """A dict keyed by object identity, as TensorFlow's savers take their object map
    (`object_identity.ObjectIdentityDictionary`): variables do not hash by identity."""
    from tensorflow.python.util import object_identity

    return object_identity.ObjectIdentityDictionary()


def copy_to_host(trackable: Any, object_map: Any) -> None:
    """Copies a variable into its CPU stand-in in `object_map` (made by the first call,
    assigned by later ones): TF's own `Trackable._copy_trackable_to_cpu`, which
    `tf.train.CheckpointOptions(enable_async=True)` uses (no public API). A Keras 3 variable
    is copied as the tf.Variable it wraps and mapped to that copy: Keras's own method makes a
    new tf.Variable on every call, which fails inside a tf.function from the second save on."""
    if isinstance(trackable, keras.Variable):
        inner = trackable.value
        inner._copy_trackable_to_cpu(object_map)
        object_map[trackable] = object_map[inner]
    else:
        trackable._copy_trackable_to_cpu(object_map)


def has_own_state(trackable: Any) -> bool:
    """Whether a checkpoint saves values of this object itself (a variable, a lookup table),
    not only of its children: the test TF's async checkpoint helper makes
    (`_serialize_to_tensors` or `_gather_saveables_for_checkpoint` defined below `Trackable`)."""
    base = tf.__internal__.tracking.Trackable
    return any(
        "_serialize_to_tensors" in klass.__dict__ or "_gather_saveables_for_checkpoint" in klass.__dict__
        for klass in type(trackable).mro()
        if klass is not base and klass is not object
    )


def save_counter(checkpoint: tf.train.Checkpoint) -> tf.Variable | None:
    """The variable `checkpoint` numbers its saves with, or None while it has none: without
    making it, which the public `save_counter` property does on first read."""
    return checkpoint._save_counter


def save_from(checkpoint: tf.train.Checkpoint, object_map: Any) -> None:
    """Makes `checkpoint`'s saves write each object's stand-in in `object_map` instead of the
    object (`TrackableSaver._object_map`, the hook TF's async checkpoint helper sets)."""
    checkpoint._saver._object_map = object_map


def run_exit_handlers() -> None:
    """What `atexit` registered, run now (CPython's `atexit._run_exitfuncs`, which the
    interpreter's own exit calls), for a process about to end with `os._exit`."""
    import atexit

    atexit._run_exitfuncs()


def compile_loss(model: Any) -> Any:
    """The loss a Keras model was compiled with, as Keras applies it (its `CompileLoss`), or
    None: `compile(loss=None)` or never compiled (no public accessor)."""
    return getattr(model, "_compile_loss", None)


def compile_arguments(model: Any) -> dict[str, Any]:
    """The arguments a Keras model's `compile()` was given (optimizer, loss, loss_weights,
    metrics, weighted_metrics, ...) as the user passed them; {} when it was never compiled.
    Keras keeps them unserialized for `get_compile_config` (no public accessor)."""
    if not getattr(model, "compiled", False):
        return {}
    config = getattr(model, "_compile_config", None)
    return dict(getattr(config, "config", None) or {})


def keras_metric(identifier: Any, y_true: Any, y_pred: Any) -> Any:
    """A metric named as `compile(metrics=)` names it ("accuracy" resolved against the labels'
    and outputs' shapes as Keras resolves it), through Keras's own resolver (not public)."""
    from keras.src.trainers.compile_utils import get_metric

    return get_metric(identifier, y_true, y_pred)


def keras_loss(identifier: Any, y_true: Any, y_pred: Any) -> Any:
    """A loss named as `compile(loss=)` names it ("crossentropy" resolved against the shapes as
    Keras resolves it), through Keras's own resolver (not public)."""
    from keras.src.trainers.compile_utils import get_loss

    return get_loss(identifier, y_true, y_pred)


def build_compiled_state(model: Any, data_batch: Any) -> None:
    """Makes a compiled Keras model's metric and loss state (its `CompileMetrics`, its loss
    tracker) from a batch's specs, as `fit` does before its first step (Keras's
    `_symbolic_build`, not public): made inside a step on several replicas instead, they fail it."""
    model._symbolic_build(data_batch=data_batch)


def give_collective_group(strategy: tf.distribute.MirroredStrategy, group_key_start: int) -> bool:
    """Makes `strategy`'s all-reduces number their collective group from `group_key_start`.

    Every MirroredStrategy numbers its collective groups and instances from the same start
    (`CollectiveKeys(group_key_start=1 + _collective_key_base)`, a class attribute), so the ops of
    a second one over the same devices pair with those of the first one's programs and abort
    every later collective in the process ("Shape mismatch in the collective instance"). The
    public API sets the start only before a strategy exists; this gives an existing one (not yet
    traced through the engine) a CollectiveAllReduce of its own with new keys, the devices and
    communication options unchanged. False where the strategy has no such collective ops (a
    user's own `cross_device_ops` keeps working as it was: it is not replaced)."""
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils

    extended = strategy.extended
    old = getattr(extended, "_collective_ops", None)
    if not isinstance(old, cross_device_ops.CollectiveAllReduce):
        return False
    keys = cross_device_utils.CollectiveKeys(group_key_start=group_key_start)
    new = cross_device_ops.CollectiveAllReduce(
        devices=extended._devices,
        group_size=len(extended._devices),
        options=extended._communication_options,
        collective_keys=keys,
    )
    if extended._cross_device_ops is old:
        extended._cross_device_ops = new
    extended._collective_ops = new
    extended._collective_keys = keys
    return True


# The names under which `tf.custom_gradient` registers a graph-mode gradient function
# (tensorflow/python/ops/custom_gradient.py: "CustomGradient-<uid>").
CUSTOM_GRADIENT_PREFIX = "CustomGradient-"


def custom_gradient_names() -> set[str]:
    """The gradient functions `tf.custom_gradient` has registered so far in graph mode.

    Each trace that calls a custom-gradient function (`ReplicaContext.all_reduce` is one: every
    optimizer update under MirroredStrategy) registers its gradient in TensorFlow's global
    gradient registry, with the tensors of the traced graph it closes over, and nothing ever
    removes it: the whole traced loop outlives the Trainer that traced it. No public API lists
    or removes the registrations."""
    from tensorflow.python.framework import ops

    return {name for name in list(ops._gradient_registry._registry) if name.startswith(CUSTOM_GRADIENT_PREFIX)}


def forget_custom_gradients(names: Sequence[str]) -> None:
    """Removes the registrations `names` (see `custom_gradient_names`): for graphs that will not be
    differentiated again, whose functions are gone or going."""
    from tensorflow.python.framework import ops

    for name in names:
        ops._gradient_registry._registry.pop(name, None)
