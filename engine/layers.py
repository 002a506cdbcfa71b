"""Keras 3 layers the engine provides: an embedding table split into row shards.

ParameterServerStrategy's `variable_partitioner` makes a `ShardedVariable`,
which Keras 3 variables cannot wrap (GradientTape fails: 'ShardedVariable'
object has no attribute 'handle'), so a Keras 3 model keeps every table whole
on one ps task. `ShardedEmbedding` holds its table as `num_shards` ordinary
variables of consecutive row ranges instead: ParameterServerStrategy places
variables round-robin over the ps tasks, so the shards spread over them, and
`tf.nn.embedding_lookup` gathers each id's row on the shard's own device, so
only the rows a batch touches travel (forward, and back as `IndexedSlices`
gradients, which the optimizer applies on that device; its slots are made
per shard, alike). Under any other strategy the shards sit side by side and
the layer is an ordinary `keras.layers.Embedding` (with replicas that
all-reduce, each shard gathers for every id: see `_gather_from_every_shard`):
one model definition runs everywhere.

The number of shards is part of the model, not of the cluster: a checkpoint
holds `num_shards` tables and restores onto any number of ps tasks (or any
other strategy); into a layer of another `num_shards` its rows (and the
optimizer slots of its shards) are re-cut on restore (`engine.checkpointing.reshard`,
which the engine's restores use). A layer given none takes `default_num_shards`'s
count where one is set (the command line's `--ps_shards`, which a model_dir keeps),
else one per ps task.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from engine.compat import keras_sublayers, num_ps
from engine.errors import UserError


def shard_rows(input_dim: int, num_shards: int) -> list[int]:
    """Rows per shard, as `tf.nn.embedding_lookup`'s "div" strategy splits them: consecutive
    ranges, the first `input_dim % num_shards` shards one row longer."""
    base, extra = divmod(input_dim, num_shards)
    return [base + (1 if index < extra else 0) for index in range(num_shards)]


# A table's check before its variables exist: (layer, count) -> None, or a UserError.
ShardCheck = Callable[["ShardedEmbedding", int], None]
_DEFAULT_NUM_SHARDS: contextvars.ContextVar[tuple[int, ShardCheck | None] | None] = contextvars.ContextVar(
    "num_shards", default=None
)
SHARDS_LISTED = 8  # describe_tables lists each shard up to this many; past it, a summary.


@contextlib.contextmanager
def default_num_shards(count: int | None, check: ShardCheck | None = None) -> Iterator[None]:
    """Within: a `ShardedEmbedding` built without `num_shards` holds `count` shards (at most
    one per row) instead of one per ps task, so that a model a builder makes keeps its shard
    count (and its checkpoints) whatever the cluster. None: no default, as outside. `check`,
    called with each such layer and `count` before its variables are made, may refuse the
    count (the command line's --ps_shards against the table: engine.cli.run.table_shards)."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise UserError(f"default_num_shards({count!r}): it must be a whole number >= 1 or None")
    token = _DEFAULT_NUM_SHARDS.set(None if count is None else (count, check))
    try:
        yield
    finally:
        _DEFAULT_NUM_SHARDS.reset(token)


def ps_tasks_in_scope() -> int:
    """The number of ps tasks of the ParameterServerStrategy in scope; 0 under any other."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return 0
    return num_ps(strategy)


def _replicas_in_sync() -> int:
    """The replicas that all-reduce gradients, in a replica context (a step) or a
    cross-replica one (Keras building the model in `strategy.scope()`)."""
    context = tf.distribute.get_replica_context()
    if context is not None:
        return context.num_replicas_in_sync
    return tf.distribute.get_strategy().num_replicas_in_sync


@keras.saving.register_keras_serializable(package="engine")
class ShardedEmbedding(keras.layers.Layer):
    """`keras.layers.Embedding` with its table in `num_shards` row shards (see the module).

    Args:
        input_dim: rows of the table (the vocabulary size; ids in [0, input_dim)).
        output_dim: the width of each row.
        num_shards: how many variables hold the table. None: `default_num_shards`'s count
            where one is set when the layer is built, else one per ps task of the
            ParameterServerStrategy in scope (1 under any other); pass a number for
            checkpoints that restore onto another number of ps tasks.
        embeddings_initializer, embeddings_regularizer: as `keras.layers.Embedding`'s,
            applied to each shard (a sum over rows, such as L1 or L2, is the same).
        mask_zero: id 0 is padding: the layer returns a mask, as `keras.layers.Embedding`.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        num_shards: int | None = None,
        *,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        mask_zero: bool = False,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        for name, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"ShardedEmbedding({name}={value!r}): it must be a whole number >= 1")
        if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)):
            raise UserError(f"ShardedEmbedding(num_shards={num_shards!r}): it must be a whole number or None")
        if num_shards is not None and not 1 <= num_shards <= input_dim:
            raise UserError(
                f"ShardedEmbedding(num_shards={num_shards}) for {input_dim} rows: each shard needs a row, "
                f"so 1 <= num_shards <= input_dim"
            )
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.num_shards = num_shards
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero

    def build(self, input_shape: Any = None) -> None:
        if self.num_shards is None:
            default = _DEFAULT_NUM_SHARDS.get()
            if default is None:
                count = max(ps_tasks_in_scope(), 1)
            else:
                count, check = default
                if check is not None:
                    check(self, count)
            self.num_shards = min(count, self.input_dim)
        for index, rows in enumerate(shard_rows(self.input_dim, self.num_shards)):
            # One attribute each (shard_0, shard_1, ...): tf.train.Checkpoint saves a Keras 3
            # layer's variables through its attributes, and one kept in a list is never saved.
            shard = self.add_weight(
                shape=(rows, self.output_dim),
                initializer=self.embeddings_initializer,
                regularizer=self.embeddings_regularizer,
                name=f"shard_{index}",
            )
            setattr(self, f"shard_{index}", shard)
        self.built = True

    @property
    def shards(self) -> list[keras.Variable]:
        """The table's variables, in row order."""
        return [getattr(self, f"shard_{index}") for index in range(self.num_shards or 0)] if self.built else []

    def call(self, inputs: Any) -> tf.Tensor:
        ids = tf.convert_to_tensor(inputs)
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, "int64")
        tables = [shard.value for shard in self.shards]
        if len(tables) > 1 and _replicas_in_sync() > 1:
            rows = self._gather_from_every_shard(tables, ids)
        else:
            rows = tf.nn.embedding_lookup(tables, ids)  # Each id's row gathered on its shard's device.
        return tf.cast(rows, self.compute_dtype)

    @staticmethod
    def _gather_from_every_shard(tables: list[tf.Tensor], ids: tf.Tensor) -> tf.Tensor:
        """The lookup where replicas all-reduce their gradients: each shard gathers a row for
        every id (its own rows, or row 0 masked out), so that each shard's IndexedSlices
        gradient has as many rows on every replica. `tf.nn.embedding_lookup`'s split gives
        each replica its own count, and TensorFlow's all-gather of IndexedSlices of unequal
        sizes fails inside a compiled loop ('Shape mismatch in the collective instance')."""
        # An id no shard holds would find only masked rows (zeros): refused, as a gather is.
        total = sum(int(table.shape[0]) for table in tables)
        checks = [
            tf.debugging.assert_non_negative(ids, message="ShardedEmbedding: negative id"),
            tf.debugging.assert_less(ids, tf.cast(total, ids.dtype), message=f"ShardedEmbedding: id >= {total}"),
        ]
        with tf.control_dependencies(checks):
            ids = tf.identity(ids)
        rows = None
        start = 0
        for table in tables:
            count = int(table.shape[0])
            local = ids - start
            inside = tf.logical_and(local >= 0, local < count)
            found = tf.gather(table, tf.where(inside, local, tf.zeros_like(local)))
            found = tf.where(inside[..., tf.newaxis], found, tf.zeros_like(found))
            rows = found if rows is None else rows + found
            start += count
        return rows

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero:
            return None
        return keras.ops.not_equal(inputs, 0)  # Keras calls it on symbolic inputs too.

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (*input_shape, self.output_dim)

    def placement(self) -> list[str]:
        """Where each shard lives: its device, e.g. '/job:ps/replica:0/task:1/device:CPU:0'."""
        return [shard.value.device for shard in self.shards]

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "num_shards": self.num_shards,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
            "mask_zero": self.mask_zero,
        }


def _short_device(device: str) -> str:
    """'/job:ps/replica:0/task:1/device:CPU:0' -> 'ps:1'; a local device by its own name."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job in ("ps", "worker", "chief"):
        return f"{spec.job}:{spec.task}"
    return f"{spec.device_type}:{spec.device_index}" if spec.device_type else device or "the default device"


def sharded_tables(model: Any) -> list[ShardedEmbedding]:
    """The built `ShardedEmbedding`s of a Keras `model` (itself included)."""
    if not isinstance(model, keras.layers.Layer):
        return []
    layers = [model, *keras_sublayers(model)]
    return [layer for layer in layers if isinstance(layer, ShardedEmbedding) and layer.built]


def describe_tables(model: Any) -> list[str]:
    """One line per `ShardedEmbedding` of a Keras `model`: its size, its shards and where each
    lives, e.g. "table 'items': 1000000 x 16 in 2 shards: 500000 rows on ps:0, 500000 on ps:1";
    past `SHARDS_LISTED` shards, how many of how many rows on each device."""
    lines = []
    for layer in sharded_tables(model):
        devices = [_short_device(device) for device in layer.placement()]
        if len(devices) <= SHARDS_LISTED:
            where = ", ".join(
                f"{shard.shape[0]} rows on {device}" for shard, device in zip(layer.shards, devices, strict=True)
            )
            shards = f"{layer.num_shards} shard(s): {where}"
        else:
            shards = _shards_summary(layer.input_dim, devices)
        lines.append(f"table {layer.name!r}: {layer.input_dim} x {layer.output_dim} in {shards}")
    return lines


def _shards_summary(rows: int, devices: list[str]) -> str:
    """'5000 shards of 20 rows: 2500 on ps:0, 2500 on ps:1': a line, however many shards."""
    sizes = shard_rows(rows, len(devices))
    low, high = min(sizes), max(sizes)
    per_device: dict[str, int] = {}
    for device in devices:
        per_device[device] = per_device.get(device, 0) + 1
    shown = [f"{count} on {device}" for device, count in list(per_device.items())[:SHARDS_LISTED]]
    if len(per_device) > SHARDS_LISTED:
        shown.append(f"and {len(per_device) - SHARDS_LISTED} more device(s)")
    of = f"{low} rows" if low == high else f"{low}-{high} rows"
    return f"{len(devices)} shards of {of}: {', '.join(shown)}"
