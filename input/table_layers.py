"""The Keras layers that turn a table's raw columns into the numbers a model takes, built from
its `input.tables.TableSchema`: the one encoding that the training split goes through, that
predict rebuilds from inputs.json, and that the exported SavedModel and `.keras` file hold.

Inputs, one (N, 1) tensor a column, by the column's name: numbers as float32 (NaN is a
blank), every other type as text ("" is a blank). Categories go through Keras's own
`StringLookup` (one-hot, one bucket for an unseen value); numbers, booleans and ISO dates
through the small layers here, which hold their fill values in their config (saved in a
`.keras` file, no variable a checkpoint must restore).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from input.tables import BOOLEAN, CATEGORY, DATE, NUMBER, TEXT, TEXT_LAYER, TRUE_WORDS, TableSchema


@keras.saving.register_keras_serializable(package="engine")
class NumberColumn(keras.layers.Layer):
    """A number, a blank (NaN) filled with `fill`; with `missing`, a 0/1 blank feature after it."""

    def __init__(self, fill: float, missing: bool, **kwargs: Any):
        kwargs.setdefault("dtype", "float32")  # Exact values (a year, a count) under a mixed policy too.
        super().__init__(**kwargs)
        self.fill, self.missing = float(fill), bool(missing)

    def call(self, inputs: Any) -> Any:
        values = tf.cast(inputs, tf.float32)
        blank = tf.math.is_nan(values)
        filled = tf.where(blank, tf.constant(self.fill, tf.float32), values)
        return tf.concat([filled, tf.cast(blank, tf.float32)], axis=-1) if self.missing else filled

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (input_shape[0], 2 if self.missing else 1)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fill": self.fill, "missing": self.missing}


@keras.saving.register_keras_serializable(package="engine")
class BooleanColumn(keras.layers.Layer):
    """1 for true/yes/t/y (any case), else 0; with `missing`, a 0/1 blank feature after it."""

    def __init__(self, missing: bool, **kwargs: Any):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.missing = bool(missing)

    def call(self, inputs: Any) -> Any:
        words = tf.strings.lower(tf.strings.strip(inputs))
        true = tf.reduce_any(tf.stack([tf.equal(words, word) for word in TRUE_WORDS], axis=-1), axis=-1)
        values = tf.cast(true, tf.float32)
        if not self.missing:
            return values
        return tf.concat([values, tf.cast(tf.equal(words, ""), tf.float32)], axis=-1)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (input_shape[0], 2 if self.missing else 1)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "missing": self.missing}


@keras.saving.register_keras_serializable(package="engine")
class DateParts(keras.layers.Layer):
    """An ISO 8601 date (2024-03-01, 2024-03-01 13:45) as its `parts` (year, month, day,
    day_of_week with Monday 0, hour), a blank as `fill` (one value a part); with `missing`,
    a 0/1 blank feature after them."""

    def __init__(self, parts: list[str], fill: list[float], missing: bool, **kwargs: Any):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.parts, self.fill, self.missing = list(parts), [float(v) for v in fill], bool(missing)

    def call(self, inputs: Any) -> Any:
        text = tf.strings.strip(inputs)
        blank = tf.equal(text, "")
        # A date alone reads hour 00 from the padding; a blank reads 1970-01-01, then its fill.
        safe = tf.where(blank, tf.constant("1970-01-01"), text) + " 00"

        def number(start: int, length: int) -> tf.Tensor:
            return tf.strings.to_number(tf.strings.substr(safe, start, length), tf.int64)

        year, month, day = number(0, 4), number(5, 2), number(8, 2)
        found = {
            "year": year,
            "month": month,
            "day": day,
            "day_of_week": _day_of_week(year, month, day),
            "hour": number(11, 2),
        }
        values = tf.concat([tf.cast(found[part], tf.float32) for part in self.parts], axis=-1)
        values = tf.where(blank, tf.constant([self.fill], tf.float32), values)
        return tf.concat([values, tf.cast(blank, tf.float32)], axis=-1) if self.missing else values

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (input_shape[0], len(self.parts) + int(self.missing))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "parts": self.parts, "fill": self.fill, "missing": self.missing}


def _day_of_week(year: tf.Tensor, month: tf.Tensor, day: tf.Tensor) -> tf.Tensor:
    """Monday 0 .. Sunday 6, from the days since 1970-01-01 (a Thursday; H. Hinnant's
    days_from_civil, in integers)."""
    year = year - tf.cast(month <= 2, tf.int64)
    era = tf.math.floordiv(year, 400)
    year_of_era = year - era * 400
    shifted = tf.where(month > 2, month - 3, month + 9)
    day_of_year = tf.math.floordiv(153 * shifted + 2, 5) + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    days = era * 146097 + day_of_era - 719468
    return tf.math.floormod(days + 3, 7)


def input_dtype(kind: str) -> str:
    return "float32" if kind == NUMBER else "string"


def input_names(schema: TableSchema) -> dict[str, str]:
    """Each column the model takes -> its name as a Keras input, a layer and a SavedModel
    signature take one: ASCII letters, digits, `_` and `.` (any other character `_`), starting
    with a letter (else `c` before it), unique (`_2`, ... after a name taken)."""
    names: dict[str, str] = {}
    for column in schema.used:
        name = "".join(c if (c.isascii() and c.isalnum()) or c in "_." else "_" for c in column.name)
        name = name if name[:1].isalpha() else f"c{name}"
        unique, count = name, 1
        while unique in names.values():
            count += 1
            unique = f"{name}_{count}"
        names[column.name] = unique
    return names


def table_inputs(schema: TableSchema) -> dict[str, keras.KerasTensor]:
    """One Keras input a column the model takes, by its `input_names` name (the dict's key too)."""
    names = input_names(schema)
    return {
        names[column.name]: keras.Input(shape=(1,), dtype=input_dtype(column.type), name=names[column.name])
        for column in schema.used
    }


def encode(schema: TableSchema, inputs: dict[str, Any]) -> Any:
    """The columns of `inputs` (by `input_names`) as one float32 (N, features) tensor, in
    `schema.feature_names()`'s order."""
    encoded = []
    keys = input_names(schema)
    for column in schema.used:
        key = keys[column.name]
        value = inputs[key]
        if column.type == NUMBER:
            encoded.append(NumberColumn(column.fill[0], column.missing, name=f"number_{key}")(value))
        elif column.type == BOOLEAN:
            encoded.append(BooleanColumn(column.missing, name=f"boolean_{key}")(value))
        elif column.type == DATE:
            layer = DateParts(list(column.parts), list(column.fill), column.missing, name=f"date_{key}")
            encoded.append(layer(value))
        elif column.type == CATEGORY:
            lookup = keras.layers.StringLookup(
                vocabulary=list(column.vocabulary),
                num_oov_indices=1,
                output_mode="one_hot",
                name=f"category_{key}",
            )
            encoded.append(keras.ops.cast(lookup(value), "float32"))
        elif column.type == TEXT:
            vocabulary = list(column.vocabulary)
            words = keras.layers.TextVectorization(vocabulary=vocabulary, name=f"text_{key}", **TEXT_LAYER)
            encoded.append(keras.ops.cast(keras.layers.Flatten()(words(value)), "float32"))
    if len(encoded) == 1:
        return encoded[0]
    return keras.layers.Concatenate(name="table_features", dtype="float32")(encoded)


def table_encoder(schema: TableSchema) -> keras.Model:
    """raw columns -> float32 (N, features): what the training split is encoded with."""
    inputs = table_inputs(schema)
    return keras.Model(inputs, encode(schema, inputs), name="table_encoder")


def table_model(schema: TableSchema, model: keras.Model, head: keras.layers.Layer | None = None) -> keras.Model:
    """`model` (which takes the encoded features) behind the encoding, and `head` after it if
    given (a softmax): raw named columns in, the model's outputs out (what the export and the
    `.keras` file hold)."""
    inputs = table_inputs(schema)
    outputs = model(encode(schema, inputs))
    return keras.Model(inputs, head(outputs) if head is not None else outputs, name=f"{model.name}_on_table")


def encode_arrays(schema: TableSchema, columns: dict[str, Any], batch: int = 65536) -> Any:
    """`columns` (input.tables.raw_columns) encoded by the schema's layers, as float32 numpy."""
    import numpy as np

    encoder, names = table_encoder(schema), input_names(schema)
    rows = len(next(iter(columns.values())))
    parts = [
        np.asarray(encoder({names[name]: values[start : start + batch] for name, values in columns.items()}))
        for start in range(0, rows, batch)
    ]
    return np.concatenate(parts).astype(np.float32)
