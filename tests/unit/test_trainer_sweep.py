"""A sweep of Trainers in one process keeps nothing of the ones it dropped (issue 47).

Every optimizer update under MirroredStrategy goes through `ReplicaContext.all_reduce`, a
`tf.custom_gradient`: each trace registered a gradient function in TensorFlow's global
registry, closing over the traced loop's tensors, and nothing removed it. Every dropped
Trainer's compiled loops stayed (16 Trainers grew the process by 9.8 MB each; measured here
with 8: 8.3 MB and 1.2 MB of Python objects each, 0.6 MB and none with the fix).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import tensorflow as tf
from helpers import make_arrays, make_trainer
from tensorflow.python.framework.func_graph import FuncGraph

from engine.compat import custom_gradient_names
from engine.options import Cadence


def engine_graphs() -> int:
    """Traced graphs alive, but tf.data's own functions (`_init_func`, `_next_func`, ...), which
    the input pipelines' background release frees in its own time."""
    return sum(1 for o in gc.get_objects() if isinstance(o, FuncGraph) and not o.name.startswith("_"))


@pytest.mark.slow  # Three Trainers trace their loops on two replicas: 8 s.
def test_a_dropped_trainer_keeps_none_of_its_traced_graphs(mirrored):
    x, y = make_arrays(40)
    gc.collect()  # What earlier tests dropped goes first.
    graphs_before, gradients_before = engine_graphs(), custom_gradient_names()
    for _ in range(3):
        trainer = make_trainer(
            mirrored,
            cadence=Cadence(steps_per_loop=2),
            eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
        )
        trainer.train(2)
        trainer.evaluate()
        trainer.predict(x)
        trainer.close()
        dropped = weakref.ref(trainer)
        del trainer
        gc.collect()
        assert dropped() is None
        assert engine_graphs() <= graphs_before  # Not one graph more a Trainer (13 each before).
    assert custom_gradient_names() <= gradients_before
