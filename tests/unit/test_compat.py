"""Every private TensorFlow/Keras API in `engine.compat` still does what the engine needs.

Fast and in-process on purpose: a TF or Keras release that moves one of
them fails here, naming both versions, before a slow test meets it."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from engine import compat
from engine.errors import UserError


@contextlib.contextmanager
def private_api(what: str):
    try:
        yield
    except (AttributeError, ImportError, TypeError) as error:
        pytest.fail(f"{what} moved in {compat.VERSIONS}: {error}")


def test_module_leaves_stop_at_keras_layers():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    module = tf.Module()
    module.dense = dense
    module.parts = [tf.Variable(1.0, name="a"), {"b": tf.Variable(2.0, name="b")}]
    with private_api("tf.Module._flatten"):
        leaves = compat.module_leaves(
            module, lambda value: isinstance(value, (tf.Variable, keras.Variable, keras.layers.Layer))
        )
    assert any(leaf is dense for leaf in leaves)
    assert sorted(leaf.name for leaf in leaves if isinstance(leaf, tf.Variable)) == ["a:0", "b:0"]
    assert not any(leaf is dense.kernel for leaf in leaves)  # Not inside the layer.


def test_module_leaves_are_the_shards_of_a_sharded_variable():
    """What ParameterServerStrategy's variable_partitioner makes of a tf.Module's variable: the
    step, the optimizer and the checkpoint need its shards (without them a tf.Module model under
    a partitioner had no trainable variables at all)."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    shards = [tf.Variable(np.ones((2, 3), "float32"), name="t/part_0"), tf.Variable(np.ones((1, 3), "float32"))]
    module = tf.Module()
    module.table = ShardedVariable(shards, name="t")
    module.bias = tf.Variable(np.zeros(3, "float32"), name="bias")
    with private_api("tf.Module._flatten"):
        leaves = compat.module_leaves(module, lambda value: isinstance(value, (tf.Variable, keras.Variable)))
    assert {id(leaf) for leaf in leaves} == {id(shards[0]), id(shards[1]), id(module.bias)}
    assert {id(v) for v in module.trainable_variables} == {id(leaf) for leaf in leaves}  # TF's own walk agrees.


def test_is_sharded_variable_tells_what_a_partitioner_made_from_a_plain_variable():
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    plain = tf.Variable(np.ones((2, 3), "float32"))
    with private_api("sharded_variable.ShardedVariable"):
        assert compat.is_sharded_variable(ShardedVariable([plain, tf.Variable(np.ones((1, 3), "float32"))]))
        assert not compat.is_sharded_variable(plain)
        assert not compat.is_sharded_variable(keras.Variable(np.ones(2, "float32")).value)


def test_keras_sublayers_are_recursive():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
    with private_api("Layer._flatten_layers"):
        sublayers = compat.keras_sublayers(outer)
    assert inner in sublayers and inner.layers[0] in sublayers and outer not in sublayers


def test_optimizer_variables_and_averages_pair_by_position():
    variables = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.zeros(3, "float32"))]
    optimizer = keras.optimizers.SGD(0.1, use_ema=True)
    optimizer.build(variables)
    with private_api("Optimizer._trainable_variables / _model_variables_moving_average"):
        built_on = compat.optimizer_variables(optimizer)
        averages = compat.optimizer_averages(optimizer)
    assert [v.shape for v in built_on] == [(2,), (3,)]
    assert [tuple(a.shape) for a in averages] == [(2,), (3,)]


def test_num_workers_of_a_single_worker_strategy():
    with private_api("StrategyExtended._num_workers"):
        assert compat.num_workers(tf.distribute.MultiWorkerMirroredStrategy()) == 1


def test_the_ps_count_is_an_attribute_parameter_server_strategy_sets():
    # A ParameterServerStrategy connects to its cluster when made: tests/cluster/test_sharded_tables.py
    # reads the count from a real one; here, that TensorFlow's class still sets the attribute read.
    import inspect

    from tensorflow.python.distribute import parameter_server_strategy_v2

    with private_api("ParameterServerStrategyV2Extended._num_ps"):
        source = inspect.getsource(parameter_server_strategy_v2.ParameterServerStrategyV2Extended)
        assert "self._num_ps = " in source


def test_the_coordination_service_and_slurm_parsers_import():
    with private_api("coordination service internals"):
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
        from tensorflow.python.distribute import multi_worker_util
        from tensorflow.python.eager import context

        assert hasattr(context.context(), "configure_coordination_service")
        assert callable(multi_worker_util.coordination_leader)
        assert coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=2).num_tasks == 2
    with private_api("SlurmClusterResolver's parsers"):
        expand_hostlist, expand_tasks_per_node = compat.slurm_hostlist_parsers()
    assert expand_hostlist("node[1-3,5]") == ["node1", "node2", "node3", "node5"]
    assert expand_tasks_per_node("2(x2),1") == [2, 2, 1]


def test_autograph_passes_a_user_error_through_unchanged():
    assert getattr(UserError, compat.AUTOGRAPH_PASS_THROUGH) is True

    @tf.function
    def traced(x):
        raise UserError("the one line")

    with pytest.raises(UserError) as caught:
        traced(tf.constant(1))
    assert str(caught.value) == "the one line", f"AutoGraph rewrote the error ({compat.VERSIONS})"


def test_a_host_copy_of_keras_and_tf_variables_is_what_a_twin_checkpoint_writes(tmp_path):
    kernel = keras.Variable(np.ones((2, 2), "float32"))
    step = tf.Variable(3, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(kernel=kernel, step=step)
    with private_api("Trackable._copy_trackable_to_cpu / TrackableSaver._object_map / object_identity"):
        object_map = compat.identity_map()
        assert compat.has_own_state(kernel) and compat.has_own_state(step)
        assert not compat.has_own_state(checkpoint)
        compat.copy_to_host(kernel, object_map)
        compat.copy_to_host(step, object_map)
        kernel.assign(np.zeros((2, 2), "float32"))  # After the copy: not saved.
        compat.save_from(checkpoint, object_map)
        path = checkpoint.write(str(tmp_path / "copy"))
    reader = tf.train.load_checkpoint(path)
    assert reader.get_tensor("kernel/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 3


def test_save_counter_is_none_until_the_public_property_makes_it():
    checkpoint = tf.train.Checkpoint(step=tf.Variable(1))
    with private_api("tf.train.Checkpoint._save_counter"):
        assert compat.save_counter(checkpoint) is None
        counter = checkpoint.save_counter  # The public property makes it.
        assert compat.save_counter(checkpoint) is counter


class _OwnCall(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)


def test_is_functional_tells_a_graph_of_layers_from_a_subclass():
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    with private_api("keras.src.models.functional.Functional"):
        assert compat.is_functional(functional)
        assert not compat.is_functional(_OwnCall())


def test_engine_graph_code_is_traced_as_written_and_user_code_inside_it_is_converted():
    def users(x):
        if x > 0:  # Needs AutoGraph: a Python `if` on a tensor.
            return x * 2
        return x * 3

    with private_api("AutoGraph's artifact marker (tensorflow/python/autograph/impl/api.py)"):

        @compat.engine_graph_code
        def engines(x):
            return compat.user_code(users)(x) + 1

        @compat.engine_graph_code
        def engines_calling_plainly(x):
            return users(x)

        traced = tf.function(lambda x: engines(x))
        assert int(traced(tf.constant(2))) == 5 and int(traced(tf.constant(-2))) == -5
        # Marked code is not converted: a user function it calls plainly would fail.
        with pytest.raises(TypeError, match="Python bool|tf.Tensor"):
            tf.function(lambda x: engines_calling_plainly(x))(tf.constant(2))
        assert compat.user_code(engines) is engines  # The engine's own code is never wrapped.


def test_op_determinism_enabled_says_whether_a_timestamp_would_fail():
    """What engine.stragglers relies on: where the getter says True, tf.timestamp fails in a
    compiled function ("Timestamp cannot be called when determinism is enabled"); where False,
    it runs. (Whichever this process is in: op determinism, once on, stays on.)"""
    try:
        tf.function(tf.timestamp)()
        fails = False
    except tf.errors.FailedPreconditionError:
        fails = True
    assert compat.op_determinism_enabled() == fails


def test_a_mirrored_strategy_given_a_collective_group_of_its_own_all_reduces_in_it():
    """`engine.strategy.own_collectives` relies on it (tests/process/test_raw_mirrored_strategies.py)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with private_api("MirroredExtended._collective_ops, CollectiveAllReduce, CollectiveKeys"):
        assert compat.give_collective_group(strategy, 7_000_000)

    @tf.function
    def total() -> tf.Tensor:
        def one_plus_id() -> tf.Tensor:
            return tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(one_plus_id), axis=None)

    assert float(total()) == 3.0
    mirrored = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()
    )
    assert compat.give_collective_group(mirrored, 7_001_000)  # Its collective ops (XLA's) only.
    assert isinstance(mirrored.extended._cross_device_ops, tf.distribute.HierarchicalCopyAllReduce)  # noqa: SLF001


def test_custom_gradients_traced_in_graph_mode_are_listed_and_forgotten():
    """A dropped Trainer forgets the ones its traces registered (tests/unit/test_trainer_sweep.py)."""

    @tf.custom_gradient
    def doubled(x):
        return 2.0 * x, lambda upstream: 2.0 * upstream

    before = compat.custom_gradient_names()
    with private_api("ops._gradient_registry._registry"):
        tf.function(doubled).get_concrete_function(tf.TensorSpec([], tf.float32))
        new = compat.custom_gradient_names() - before
        assert len(new) == 1 and next(iter(new)).startswith(compat.CUSTOM_GRADIENT_PREFIX)
        compat.forget_custom_gradients(sorted(new))
        assert compat.custom_gradient_names() == before
