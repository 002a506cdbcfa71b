"""A table of any column types as an in-memory data source (`input.tables` says how each column
is read): split as a numbers-only CSV is split (the same rows held out), its columns' types
inferred from the training rows, encoded by the schema's Keras layers, labels read as class
names where they are text. Every problem that keeps the table from being used is one line."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from input.arrays import source_from_arrays, split_off_eval
from input.errors import DataError
from input.in_memory import InMemorySource
from input.tables import TableSchema, check_cells, infer_schema, parse_column_types, raw_columns, read_frame


def load_table(
    path: str,
    *,
    label_column: str | None,
    eval_file: str | None,
    eval_fraction: float,
    label_kind: str | None,
    num_classes: int | None,
    column_types: list[str] | None = None,
) -> InMemorySource:
    """The table at `path` (and `eval_file`) as an InMemorySource whose `table` is its schema."""
    if not label_column:
        raise DataError(f"--dataset={path} needs --label_column=NAME, the column that holds the labels")
    types = parse_column_types(column_types)
    frame = read_frame(path)
    if label_column not in frame.columns:
        raise DataError(
            f"--dataset={path} has no column {label_column!r}; its columns are {list(frame.columns)}"
        )
    if eval_file:
        held = read_frame(eval_file, "eval_file")
        if set(held.columns) != set(frame.columns):
            raise DataError(
                f"--eval_file={eval_file} has the columns {list(held.columns)}, --dataset={path} has "
                f"{list(frame.columns)}; give both files the same columns"
            )
        train = frame
    else:
        rows = np.arange(len(frame))
        (train_rows, _), held_split = split_off_eval(rows[:, None], rows, eval_fraction, path)
        train = frame.iloc[train_rows[:, 0]]
        held = None if held_split is None else frame.iloc[held_split[1]]
    train, dropped = _labelled(train, label_column)
    if held is not None:
        held, dropped_held = _labelled(held, label_column)
        dropped += dropped_held
    if len(train) == 0:
        raise DataError(f"--dataset={path}: the label {label_column!r} is blank in every training row")
    schema, problems = infer_schema(train, label_column, types, f"--dataset={path}")
    classes, label_problems = _classes(train, held, label_column, num_classes)
    problems += label_problems
    if held is not None:
        problems += check_cells(held, schema, "the eval split")
    if problems:
        raise DataError(f"--dataset={path} cannot be used as it is: " + "; ".join(problems))
    schema = dataclasses.replace(schema, classes=classes, dropped_rows=dropped)
    from input.table_layers import encode_arrays

    train_xy = (encode_arrays(schema, raw_columns(train, schema)), _labels(train[label_column], classes))
    eval_xy = None
    if held is not None and len(held):
        eval_xy = (encode_arrays(schema, raw_columns(held, schema)), _labels(held[label_column], classes))
    source = source_from_arrays(
        os.path.basename(path),
        train_xy,
        eval_xy,
        label_kind=label_kind,
        num_classes=len(classes) if classes else num_classes,
    )
    return dataclasses.replace(source, table=schema)


def _labelled(frame: Any, label: str) -> tuple[Any, int]:
    """The rows whose label is not blank, and how many were left out."""
    keep = frame[label] != ""
    return frame[keep], int((~keep).sum())


def _classes(
    train: Any, held: Any, label: str, num_classes: int | None
) -> tuple[tuple[str, ...] | None, list[str]]:
    """The class names of a text label (sorted), None for a label of numbers; and its problems."""
    cells = train[label] if held is None else np.concatenate([train[label].to_numpy(), held[label].to_numpy()])
    values = [str(cell) for cell in cells]
    try:
        [float(value) for value in values]
        return None, []
    except ValueError:
        pass
    names = tuple(sorted(set(values)))
    if len(names) < 2:
        return names, [
            f"the label {label!r} holds one class ({names[0]!r}) only; a classifier needs two or more"
        ]
    if num_classes is not None and num_classes != len(names):
        return names, [f"--num_classes={num_classes} but the label {label!r} names {len(names)} classes"]
    return names, []


def _labels(cells: Any, classes: tuple[str, ...] | None) -> np.ndarray:
    """Class ids of named classes, or the label's numbers as the numeric reader reads them:
    integers written as integers are class ids, anything else a value."""
    values = [str(cell) for cell in cells]
    if classes is not None:
        index = {name: position for position, name in enumerate(classes)}
        return np.array([index[value] for value in values], dtype=np.int64)
    numbers = np.array([float(value) for value in values], dtype=np.float64)
    if all(value.lstrip("+-").isdigit() for value in values):
        return numbers.astype(np.int64)
    return numbers


def schema_of(source: Any) -> TableSchema | None:
    """The table schema a source was read with, None for other data."""
    return getattr(source, "table", None)
