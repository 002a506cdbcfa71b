"""Non-trainable state that replicas update apart, made one value again after every loop.

Keras layers update some non-trainable variables in their forward pass, with aggregation
"none": BatchNormalization's moving mean and variance. Under a mirrored strategy each
replica then updates its own copy from its own batch and the copies drift apart: an
evaluation on replica r uses replica r's statistics while a checkpoint saves replica 0's,
so the evaluation a run reports is not what its checkpoint gives (Keras `fit` has the same
flaw). The engine averages such variables over the replicas at the end of every compiled
training loop, inside it (one all-reduce a loop, not a step).

The average is what the replicas' updates would have made of one shared copy: a moving
average is linear in its inputs, so the mean of the replicas' moving means, all started
from one value, is the moving average of the replicas' mean batch statistics.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from engine.compat import engine_graph_code
from engine.variables import all_variables


def replica_local_state(strategy: tf.distribute.Strategy, model: Any) -> list[Any]:
    """The model's variables that each replica updates on its own (floating point, not
    trained, mirrored with aggregation "none"); [] where there is one replica, or no
    mirrored copies (parameter servers hold one)."""
    if strategy.num_replicas_in_sync < 2:
        return []
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return []
    found = []
    for variable in all_variables(model):
        inner = variable.value if isinstance(variable, keras.Variable) else variable
        if getattr(variable, "trainable", False) or not inner.dtype.is_floating:
            continue
        if not isinstance(inner, tf.distribute.DistributedValues):
            continue
        if (
            inner.aggregation == tf.VariableAggregation.NONE
            and inner.synchronization != tf.VariableSynchronization.ON_READ
        ):
            found.append(variable)
    return found


@engine_graph_code
def average_over_replicas(strategy: tf.distribute.Strategy, variables: list[Any]) -> None:
    """Sets every replica's copy of each variable to the mean of the copies (one all-reduce
    of them all). Called in cross-replica context, inside a compiled loop."""
    if not variables:
        return

    @engine_graph_code
    def replica_fn() -> None:
        context = tf.distribute.get_replica_context()
        local = [tf.identity(variable) for variable in variables]  # This replica's copies.
        means = context.all_reduce(tf.distribute.ReduceOp.MEAN, local)
        for variable, mean in zip(variables, means, strict=True):
            variable.assign(mean)  # Aggregation "none": each replica sets its own copy.

    strategy.run(replica_fn)
