"""Variable-length batches on several replicas: one training step per compiled call.

TensorFlow resolves each collective op (its devices and its tensor's shape) once per
call of a function: every later run of that op in the same call, such as the next
step of the engine's multi-step loop, must bring the same shape, or every collective
of the process aborts ("Shape mismatch in the collective instance"; only a restart
recovers). An `Embedding`'s gradient is `IndexedSlices` with a row per token of the
replica's batch, which `MirroredStrategy` and `MultiWorkerMirroredStrategy` sum by
gathering the replicas' rows: with a new sequence length each batch (`padded_batch`
without fixed `padded_shapes`, `bucket_by_sequence_length`) that gather changes shape
from one step to the next. Keras `fit` with `steps_per_execution > 1` fails alike.

Making those gradients dense would keep the gather's shape fixed, but not the update:
Keras's optimizers compute on the pieces of a sparse gradient (Adam squares each row
of it before adding them up), so a dense gradient trains differently from one replica
and from `fit`. The engine therefore runs such data one step per call, which is
exactly `steps_per_loop=1`, and says so once. Shapes fixed by the data (a
`padded_shapes` length) keep the multi-step loop. Evaluation has no collective inside
its calls and keeps its batches per call.

A partial last batch changes that shape too. Where a dataset of global batches says
how many it holds (`cardinality()`: `from_tensor_slices(...).batch(B)`), its last batch
runs in a call of its own, which costs one call and no warning; a dataset that cannot
tell (a generator, a `filter`) needs `drop_remainder=True` or `repeat()`.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from engine.callbacks.base import Callback, TrainerView
from engine.compat import keras_sublayers
from engine.data import DataForm, GlobalBatches, element_spec
from engine.logger import logger
from engine.resident import ResidentData


class LastBatchAlone(Callback):
    """Ends the loop before the stream position `last` (a finite dataset's last batch, maybe a
    partial one), so that the batch runs in a call of its own: a partial batch changes the
    gather's shape as a new length does (an engine hook, made by `one_step_per_call`)."""

    def __init__(self, last: int):
        self.last = last

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        position = getattr(trainer, "data_position", None)
        at = position.at(step) if position is not None else step  # Past the batches rollbacks skipped.
        return self.last - at if at < self.last else None


class OneStepPerCall(Callback):
    """Cuts every training loop to one step (an engine hook, made by `one_step_per_call`)."""

    def loop_limit(self, trainer: TrainerView, step: int) -> int | None:
        return 1


def may_have_sparse_gradients(model: Any) -> bool:
    """Whether a gradient of `model` may be `IndexedSlices` (a row per looked-up id, whose all-reduce
    gathers rows: the collective whose shape follows the batch): a Keras model with an `Embedding`
    (or a subclass) among its layers; a plain `tf.Module`, whose lookups cannot be told, is
    taken to. A Keras model without one has only dense, fixed-shape gradients."""
    if not isinstance(model, keras.layers.Layer):
        return True
    layers = [model, *keras_sublayers(model)]
    return any(isinstance(layer, keras.layers.Embedding) for layer in layers)


def one_step_per_call(
    strategy: tf.distribute.Strategy, data: DataForm | ResidentData, steps_per_loop: int, model: Any = None
) -> list[Callback]:
    """`[OneStepPerCall()]` where the training data's batches vary in a dimension other than the
    batch (read from its element spec, before anything is traced) and more than one replica
    sums gradients with collectives inside loops of several steps (one warning line says so);
    else `[LastBatchAlone(...)]` where the data's last batch may be partial (`_last_batch_alone`),
    or `[]`. Only for a `model` whose gradients may be sparse (`may_have_sparse_gradients`): dense
    gradients keep their shape whatever the batch."""
    if steps_per_loop == 1 or strategy.num_replicas_in_sync == 1 or not _reduces_with_collectives(strategy):
        return []
    if model is not None and not may_have_sparse_gradients(model):
        return []
    if isinstance(data, ResidentData):  # Arrays: one shape for every batch.
        return []
    spec = element_spec(strategy, data)
    varying = _varying_shape(spec)
    if varying is None:
        return _last_batch_alone(data, spec)
    logger.warning(
        "train_data's batches vary in length (an element of shape %s) on %d replicas: training runs 1 step "
        "per compiled call instead of steps_per_loop=%d (TensorFlow aborts a call whose collectives change "
        "shape between steps, as an Embedding's gradient does), a host round trip a step; pad every batch "
        "to one length (padded_batch(..., padded_shapes=...)) to keep %d steps a call",
        varying,
        strategy.num_replicas_in_sync,
        steps_per_loop,
        steps_per_loop,
    )
    return [OneStepPerCall()]


def _last_batch_alone(data: DataForm, element_spec: Any) -> list[Callback]:
    """`[LastBatchAlone(last)]` for a dataset of global batches of a known, finite number whose
    batch dimension is not fixed (`batch()` without `drop_remainder`): its last batch may be
    partial. It costs one more call at the end of the data; no warning."""
    if not isinstance(data, GlobalBatches) or data.dataset is None:
        return []
    leaves = [spec for spec in tf.nest.flatten(element_spec) if getattr(spec, "shape", None) is not None]
    if not leaves or all(spec.shape.rank and spec.shape[0] is not None for spec in leaves):
        return []
    batches = int(data.dataset.cardinality())
    return [LastBatchAlone(batches - 1)] if batches > 1 else []


def _reduces_with_collectives(strategy: tf.distribute.Strategy) -> bool:
    """Mirrored and multi-worker mirrored strategies do; a parameter server updates its variables
    itself, and a TPU compiles static shapes."""
    return not isinstance(
        strategy, (tf.distribute.experimental.ParameterServerStrategy, tf.distribute.TPUStrategy)
    )


def _varying_shape(element_spec: Any) -> str | None:
    """The shape (as a list) of the first element whose dimensions after the batch are not all known."""
    for spec in tf.nest.flatten(element_spec, expand_composites=False):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            continue
        if shape.rank > 1 and any(size is None for size in shape.as_list()[1:]):
            return str(shape.as_list())
    return None
