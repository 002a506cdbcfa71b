"""Checkpoints of `engine.ShardedEmbedding` tables restored into another number of shards.

A table's shards are variables of their own, and a Keras 3 optimizer keeps the variables it
trains and its slots (Adam's `m` and `v` per shard) in positional lists: a checkpoint of 3
shards cannot restore into a model of 2 by TensorFlow's matching alone (the shard variables
differ, and every slot after the table's moves). What TensorFlow does for its own
`ShardedVariable` (each shard saved as a slice of one full tensor, read back in any
partitioning) is done here at restore time, on the checkpoint's values: when a table of the
model has another number of shards than the checkpoint's, `resharded` writes a translation
of the checkpoint in this program's layout (in memory) whose tables, and the optimizer slots
of their shards, are the stored rows concatenated and cut again at the new shard boundaries
(`engine.layers.shard_rows`); every other value is copied as it is. The translation is then
restored as the checkpoint would be, with the same checks (`translated`: the Checkpointer's
restore and the evaluator's read use it).

Values are matched by what they are, read from both object graphs (`_Stored`), not by their
checkpoint keys nor by variable names (a second model in a process has other names): each
object by its path outside the optimizers, a table's shard by (its table's path, its index),
and an optimizer's slot by the variable its position refers to (`_momentums[i]` is the slot
of `_trainable_variables[i]`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from engine.errors import UserError
from engine.layers import ShardedEmbedding, shard_rows
from engine.logger import logger

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# Made by a `tf.train.Checkpoint` on first use: a checkpoint written without it restores all the same.
_OPTIONAL = re.compile(r"^save_counter/")
_SHARD = re.compile(r"^shard_(\d+)$")
_translations = itertools.count()
Path = tuple[str, ...]


@dataclass(frozen=True)
class _Program:
    """What the object graph of a program tells apart: where its optimizers are (their lists
    are positional: they are read by what they refer to) and its tables, by path."""

    optimizers: frozenset[Path]
    tables: dict[Path, str]  # A ShardedEmbedding's path from the checkpoint's root: its name.


def program_of(checkpoint: tf.train.Checkpoint) -> _Program:
    """The optimizers' and tables' paths in `checkpoint`, found breadth first as `_Stored`
    walks a checkpoint's graph, not entering an optimizer."""
    paths: dict[int, Path] = {id(checkpoint): ()}
    queue, optimizers, tables = collections.deque([checkpoint]), set(), {}
    while queue:
        node = queue.popleft()
        for name, child in tf.train.TrackableView.children(node).items():
            if id(child) in paths:
                continue
            path = paths[id(node)] + (name,)
            paths[id(child)] = path
            if isinstance(child, keras.optimizers.Optimizer):
                optimizers.add(path)
                continue
            if isinstance(child, ShardedEmbedding) and child.built:
                tables[path] = child.name
            queue.append(child)
    return _Program(frozenset(optimizers), tables)


class _Stored:
    """A checkpoint's values by what they are, whatever the number of shards: each value under
    the path that reaches its object outside the optimizers; a table's shard as (the table's
    path, its index); an optimizer's slot by the variable its position in the optimizer's
    lists refers to (`_momentums[i]` is the slot of `_trainable_variables[i]`)."""

    def __init__(self, path: str, program: _Program):
        self.reader = tf.compat.v1.train.NewCheckpointReader(path)
        self.shapes = self.reader.get_variable_to_shape_map()
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(self.reader.get_tensor(OBJECT_GRAPH_KEY))
        self.nodes = graph.nodes
        self.identity: dict[int, tuple] = {}
        optimizers = self._walk(0, (), program.optimizers)
        for node_id, where in optimizers.items():
            self._optimizer(node_id, where)
        self.key_of: dict[tuple, str] = {}
        self.identity_of: dict[str, tuple] = {}
        for node_id, node in enumerate(self.nodes):
            for attribute in node.attributes:
                identity = (self.identity.get(node_id, ("key", attribute.checkpoint_key)), attribute.name)
                self.key_of[identity] = attribute.checkpoint_key
                self.identity_of[attribute.checkpoint_key] = identity

    def _walk(self, start: int, prefix: Path, optimizers: frozenset[Path] = frozenset()) -> dict[int, Path]:
        """Breadth first from node `start` (at `prefix`): each node's path, a table's shards by
        index; returns the optimizers met (not entered)."""
        found: dict[int, Path] = {}
        queue = collections.deque([(start, prefix)])
        self.identity.setdefault(start, ("path", *prefix))
        while queue:
            node_id, path = queue.popleft()
            for child in self.nodes[node_id].children:
                if child.node_id in self.identity or child.node_id in found:
                    continue
                child_path = (*path, child.local_name)
                if child_path in optimizers:
                    found[child.node_id] = child_path
                    continue
                shard = _SHARD.match(child.local_name)
                if shard and self.nodes[child.node_id].attributes:  # A table's shard: by its index.
                    self.identity[child.node_id] = ("shard", "/".join(path), int(shard.group(1)))
                else:
                    self.identity[child.node_id] = ("path", *child_path)
                queue.append((child.node_id, child_path))
        return found

    def _optimizer(self, node_id: int, path: Path) -> None:
        """An optimizer's variables: a list as long as `_trainable_variables` holds one slot of
        each (by the variable at its index); the rest by path (`_iterations`, ...)."""
        children = {child.local_name: child.node_id for child in self.nodes[node_id].children}
        self.identity[node_id] = ("path", *path)
        variables = self._listed(children.get("_trainable_variables"))
        referred = [self.identity.get(variable) for variable in variables]
        for name, child in children.items():
            if name in ("_variables", "_trainable_variables"):
                continue
            listed = self._listed(child)
            if variables and len(listed) == len(variables):
                for index, slot in enumerate(listed):
                    self.identity.setdefault(slot, ("slot", *path, name, referred[index]))
            elif "_trainable_variables" in {c.local_name for c in self.nodes[child].children}:
                self._optimizer(child, (*path, name))  # An optimizer inside (a loss-scale one's).
            else:
                self._walk(child, (*path, name))

    def _listed(self, node_id: int | None) -> list[int]:
        """The nodes of a list node (children named 0, 1, ...), in order; [] for another node."""
        if node_id is None:
            return []
        children = self.nodes[node_id].children
        if not children or not all(child.local_name.isdigit() for child in children):
            return []
        return [child.node_id for child in sorted(children, key=lambda child: int(child.local_name))]

    def value(self, key: str) -> np.ndarray:
        return self.reader.get_tensor(key)


def _part(identity: tuple) -> tuple[tuple, int] | None:
    """(the whole it is part of, its index) of a value of a table's shard, or of a slot of one:
    ("shard", table, i) and ("slot", optimizer, list, ("shard", table, i)); else None."""
    (kind, *rest), attribute = identity
    if kind == "shard":
        table, index = rest
        return ("table", table, attribute), index
    if kind == "slot" and rest[-1] is not None and rest[-1][0] == "shard":
        _, table, index = rest[-1]
        return ("slot", *rest[:-1], table, attribute), index
    return None


def _layout(stored: _Stored) -> dict[tuple, list[int]]:
    """Each table (and slot of one) the checkpoint holds: its shards' rows, in order."""
    shards: dict[tuple, dict[int, int]] = {}
    for key, identity in stored.identity_of.items():
        part = _part(identity)
        if part is not None:
            shape = stored.shapes.get(key, [])
            shards.setdefault(part[0], {})[part[1]] = int(shape[0]) if shape else 0
    return {whole: [rows[index] for index in sorted(rows)] for whole, rows in shards.items()}


def resharded(path: str, checkpoint: tf.train.Checkpoint, *, partial: str = "") -> str | None:
    """A translation of the checkpoint at `path` into the layout of `checkpoint`'s tables (a
    prefix in memory, for `checkpoint.restore`/`read`), or None when every table has the
    checkpoint's number of shards (or the program has none). `partial`: "leftover" lets values
    of the checkpoint go unused (a read-only evaluator), "both" also takes the program's own
    values where the checkpoint has none (a restore with a fresh optimizer)."""
    program = program_of(checkpoint)
    if not program.tables:
        return None
    stored = _Stored(path, program)
    stored_layout = _layout(stored)
    tables = {"/".join(table): name for table, name in program.tables.items()}
    counts = {
        whole[1]: len(rows)
        for whole, rows in stored_layout.items()
        if whole[0] == "table" and whole[1] in tables
    }
    wanted = {"/".join(table): len(_rows_of(table, checkpoint)) for table in program.tables}
    changed = {table: count for table, count in counts.items() if count != wanted[table]}
    if not changed:
        return None
    directory = f"ram://engine-reshard-{os.getpid()}-{next(_translations)}"
    _ = checkpoint.save_counter  # Made by the write below: made first, it is in the layout written.
    fresh = _Stored(checkpoint.write(os.path.join(directory, "layout"), options=in_this_process()), program)
    values = _translate(stored, fresh, path, partial, tables)
    target = os.path.join(directory, "resharded")
    names = sorted(values)
    with tf.device(_this_process()):
        tf.raw_ops.SaveV2(
            prefix=target,
            tensor_names=names,
            shape_and_slices=[""] * len(names),
            tensors=[tf.constant(values[name]) for name in names],
        )
    for table, count in changed.items():
        logger.info(
            "table %r: %d shard(s) in %s, re-cut into %d on restore",
            tables[table],
            count,
            path,
            wanted[table],
        )
    return target


def _rows_of(path: Path, checkpoint: tf.train.Checkpoint) -> list[int]:
    """The rows of each shard of the table at `path` in `checkpoint`'s program."""
    node: Any = checkpoint
    for name in path:
        node = tf.train.TrackableView.children(node)[name]
    return shard_rows(node.input_dim, node.num_shards)


@contextlib.contextmanager
def translated(
    path: str, checkpoint: tf.train.Checkpoint, *, partial: str = ""
) -> Iterator[tuple[str, tf.train.CheckpointOptions | None]]:
    """Within: what to restore for the checkpoint at `path` and how: `path` itself, or its
    translation (`resharded`) when a table of `checkpoint` has another number of shards, read
    by this process (`in_this_process`); dropped after."""
    target = resharded(path, checkpoint, partial=partial)
    try:
        yield (path, None) if target is None else (target, in_this_process())
    finally:
        if target is not None:
            tf.io.gfile.rmtree(os.path.dirname(target))


def in_this_process() -> tf.train.CheckpointOptions:
    """Reads and writes by this process: the translation lives in its memory (`ram://`), which
    the ps tasks of a ParameterServerStrategy, saving and restoring their own variables, cannot
    reach."""
    return tf.train.CheckpointOptions(experimental_io_device=_this_process())


def _this_process() -> str:
    """This process's first CPU (`/job:chief/.../device:CPU:0` on a parameter-server coordinator)."""
    return tf.config.list_logical_devices("CPU")[0].name


def _translate(
    stored: _Stored, fresh: _Stored, path: str, partial: str, names: dict[str, str]
) -> dict[str, Any]:
    """Every value `fresh`'s layout holds, from `stored`: the tables and their slots re-cut,
    the rest copied. A value the checkpoint lacks or leaves over is refused (a model that
    does not match), as the restore would refuse it."""
    values: dict[str, Any] = {OBJECT_GRAPH_KEY: fresh.value(OBJECT_GRAPH_KEY)}
    used: set[str] = set()
    wholes: dict[tuple, np.ndarray] = {}
    fresh_layout = _layout(fresh)
    for key, identity in fresh.identity_of.items():
        part = _part(identity)
        if part is not None:
            whole, index = part
            if whole not in wholes:
                wholes[whole] = _whole(stored, whole, sum(fresh_layout[whole]), used, path, names)
            start = sum(fresh_layout[whole][:index])
            values[key] = wholes[whole][start : start + fresh_layout[whole][index]]
            continue
        old = stored.key_of.get(identity)
        if old is None:
            if _OPTIONAL.match(key) or partial == "both":
                values[key] = fresh.value(key)
                continue
            raise UserError(f"checkpoint {path} does not match this model: it holds nothing for {key!r}")
        values[key] = stored.value(old)
        used.add(old)
    left = sorted(key for key in set(stored.identity_of) - used if not _OPTIONAL.match(key))
    if left and not partial:
        raise UserError(f"checkpoint {path} does not match this model: {left[0]!r} has no place in it")
    return values


def _whole(
    stored: _Stored, whole: tuple, rows: int, used: set[str], path: str, names: dict[str, str]
) -> np.ndarray:
    """The stored table (or one slot of it) as one array: its shards' rows in order."""
    parts: dict[int, tuple[str, np.ndarray]] = {}
    for key, identity in stored.identity_of.items():
        part = _part(identity)
        if part is not None and part[0] == whole:
            parts[part[1]] = (key, stored.value(key))
    table = whole[-2]
    what = f"table {names.get(table, table)!r}" + ("" if whole[0] == "table" else f" ({whole[-3]})")
    if not parts or sorted(parts) != list(range(len(parts))):
        raise UserError(
            f"checkpoint {path} holds shards {sorted(parts)} of {what}; it cannot be re-cut: a shard is missing"
        )
    array = np.concatenate([parts[index][1] for index in range(len(parts))], axis=0)
    if array.shape[0] != rows:
        raise UserError(
            f"checkpoint {path} holds {array.shape[0]} rows of {what}, this model {rows}; "
            "use the vocabulary size it was trained with"
        )
    used.update(key for key, _ in parts.values())
    return array
