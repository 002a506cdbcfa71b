"""`<model_dir>/inputs.json`: what a training run's examples were, for `--mode=predict`.

Predict rebuilds the trained model, which needs the examples' shape and the labels' kind
and width, and reads a CSV's columns by the names the model was trained on. The training
(its chief, beside config.yaml, once every check has passed) records them here, so that
predict reads no training data: the training CSV may be gone, and a model_dir handed over
needs none of its data. A model_dir without the file (an older run) is predicted as
before, from the training's data.

    {"feature_shape": [8], "feature_dtype": "float32",
     "labels": {"kind": "classes", "width": 3, "shape": []}, "num_train_examples": 900,
     "feature_columns": ["age", "dose", ...], "label_column": "outcome"}

`feature_columns` and `label_column` are null for data other than a CSV. A table read by its
columns' types (text, blanks, dates: `input.tables`) adds `"table"`: each column's type and
what its encoding holds (vocabulary, fill values, date parts), the label's class names; its
`feature_columns` are the encoded features' names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import tensorflow as tf

from engine import model_dir as model_dir_lib
from engine.cli.config.settings import INT32_MAX, INT64_MAX
from engine.cli.config.small_files import read_small_file
from engine.cli.process.own_packages import own_package
from engine.cli.run.run_task import RunTask
from engine.errors import UserError

INPUTS_FILE = "inputs.json"
_MAX_RANK = 8  # Example shapes: (features,), (H, W, C), (T, F), ...
_FEATURE_DTYPES = ("float32", "uint8")


@dataclasses.dataclass(frozen=True)
class InputsRecord:
    feature_shape: tuple[int, ...]
    feature_dtype: str
    label_kind: str
    label_width: int
    label_shape: tuple[int, ...]
    num_train_examples: int | None
    feature_columns: tuple[str, ...] | None
    label_column: str | None
    table: Any = None  # input.tables.TableSchema of a table read by its columns' types.

    def source(self, name: str) -> Any:
        """An input.DescribedSource of these examples: a model is built from it, no data read."""
        input_lib = own_package("input")
        return input_lib.DescribedSource(
            name=name,
            labels=input_lib.LabelSpec(self.label_kind, self.label_width, self.label_shape),
            feature_shape=self.feature_shape,
            num_train_examples=self.num_train_examples,
            num_eval_examples=None,
            stored_dtype=self.feature_dtype,
        )


def inputs_path(model_dir: str) -> str:
    return os.path.join(model_dir, INPUTS_FILE)


def record_of(task: RunTask, label_column: str | None) -> dict[str, Any]:
    source = task.source
    return {
        "feature_shape": [int(size) for size in source.feature_shape],
        "feature_dtype": source.feature_dtype,
        "labels": {
            "kind": source.labels.kind,
            "width": int(source.labels.width),
            "shape": [int(size) for size in source.labels.shape],
        },
        "num_train_examples": source.num_train_examples,
        "feature_columns": list(task.feature_columns) if task.feature_columns is not None else None,
        "label_column": label_column if task.feature_columns is not None else None,
        "table": None if getattr(source, "table", None) is None else source.table.as_json(),
    }


def check_writable(model_dir: str) -> None:
    """Before the first write: a directory where inputs.json goes is refused, not a traceback."""
    path = inputs_path(model_dir)
    if tf.io.gfile.isdir(path):
        raise UserError(f"{path} is a directory; move it away, the run records its examples' shape there")


def write(model_dir: str, task: RunTask, label_column: str | None) -> None:
    """Writes `<model_dir>/inputs.json` atomically."""
    model_dir_lib.write_json(inputs_path(model_dir), record_of(task, label_column))


def read(model_dir: str) -> InputsRecord | None:
    """The record of `model_dir`, checked; None when there is none (an older run). A damaged
    or hand-broken one is one line naming it."""
    path = inputs_path(model_dir)
    if not tf.io.gfile.exists(path):
        return None
    fix = "restore it or move it away (predict then reads the training's data again)"
    where = f"{path} (what the training's examples were)"
    try:
        data = json.loads(read_small_file(path, where, fix=fix).decode("utf-8"))
        return _checked(data)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise UserError(f"{where} is damaged; {fix}") from None


def _checked(data: dict[str, Any]) -> InputsRecord:
    """The record in `data`, every field of its type and range (ValueError otherwise)."""
    shape = tuple(_count(size, 1) for size in data["feature_shape"])
    if not 1 <= len(shape) <= _MAX_RANK or math.prod(shape) > INT32_MAX:
        raise ValueError("feature_shape")
    if data["feature_dtype"] not in _FEATURE_DTYPES:
        raise ValueError("feature_dtype")
    labels = data["labels"]
    label_shape = tuple(_count(size, 1) for size in labels["shape"])
    examples = data["num_train_examples"]
    columns = data["feature_columns"]
    label_column = data["label_column"]
    if columns is not None:
        if not isinstance(columns, list) or not all(isinstance(name, str) for name in columns):
            raise ValueError("feature_columns")
        if len(set(columns)) != len(columns) or (math.prod(shape), len(shape)) != (len(columns), 1):
            raise ValueError("feature_columns")
    if label_column is not None and not isinstance(label_column, str):
        raise ValueError("label_column")
    own_package("input").LabelSpec(labels["kind"], _count(labels["width"], 1), label_shape)  # Checks them.
    table = None
    if data.get("table") is not None:
        table = own_package("input").tables.TableSchema.from_json(data["table"])
        if tuple(table.feature_names()) != tuple(columns or ()):
            raise ValueError("table")
    return InputsRecord(
        feature_shape=shape,
        feature_dtype=data["feature_dtype"],
        label_kind=labels["kind"],
        label_width=labels["width"],
        label_shape=label_shape,
        num_train_examples=None if examples is None else _count(examples, 0, INT64_MAX),
        feature_columns=None if columns is None else tuple(columns),
        label_column=label_column,
        table=table,
    )


def _count(value: Any, least: int, most: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(value)
    return value
