"""A table as it comes (`--dataset=PATH.csv` or `PATH.parquet`): strings, blanks, dates and
named labels, each column's type inferred from the training split.

A CSV of numbers alone is read as before (`input.files`: every column a feature). Any other
table is read here with pandas (pyarrow for Parquet), split as `input.arrays.split_off_eval`
splits (the same rows held out), and described by a `TableSchema`, inferred from the
training rows alone:

- number: the value; a blank gets the training median, plus a 0/1 "missing" feature where
  the training split has blanks;
- boolean (true/false, yes/no, t/f, y/n): 1 or 0, blanks as for numbers;
- category: one-hot over the training split's values (most frequent first), one bucket for
  a value it never saw; a blank is its own category where the training split has blanks;
- date (ISO 8601: 2024-03-01, 2024-03-01 13:45): year, month, day, day of week (and hour
  where the training split has times), blanks as for numbers;
- identifier (nearly one value per row: a name, a row number) and free text (several words
  a cell): left out, said in one line each; `drop`: left out as asked;
- text, where --column_types asks for it: which of the training split's most frequent
  words (Keras's `TextVectorization`, up to MAX_WORDS) a cell holds.

The encoding is Keras preprocessing layers built from the schema (`input.table_layers`):
the same layers encode the training split here, rebuild from `inputs.json` for predict,
and sit inside the exported model, so every path applies the same preprocessing. Problems
that make a table unusable are gathered and said in one line, every column at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from input.errors import DataError

NUMBER, BOOLEAN, CATEGORY, DATE, IDENTIFIER, TEXT, DROP = (
    "number",
    "boolean",
    "category",
    "date",
    "identifier",
    "text",
    "drop",
)
COLUMN_TYPES = (NUMBER, BOOLEAN, CATEGORY, DATE, IDENTIFIER, TEXT, DROP)
TRUE_WORDS = ("true", "yes", "t", "y")
_BOOLEAN_PAIRS = ({"true", "false"}, {"yes", "no"}, {"t", "f"}, {"y", "n"})
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?$")
DATE_PARTS = ("year", "month", "day", "day_of_week")
# A string column with at least this share of distinct values (among its training cells) is an
# identifier or free text, from this many training rows on (fewer rows tell too little).
IDENTIFIER_SHARE = 0.5
MOSTLY = 0.9  # The share of a column's cells that are numbers (or dates) from which the rest are strays.
MIN_ROWS_TO_CALL_IDENTIFIER = 20
TEXT_WORDS = 3.0  # Words a cell on average from which a many-valued string column is free text.
MAX_WORDS = 1000  # A text column's words, when asked for: the most frequent in the training split.
# How a text column's layer (input.table_layers) reads its cells: the same settings count its words here.
TEXT_LAYER = {"standardize": "lower_and_strip_punctuation", "split": "whitespace", "output_mode": "multi_hot"}


@dataclasses.dataclass(frozen=True)
class Column:
    """One column as the model takes it. `fill`: what a blank becomes (the training median, of
    each date part); `missing`: a 0/1 feature says the cell was blank; `vocabulary`: a
    category's values (a blank is ""); `parts`: a date's parts; `note`: why it is left out."""

    name: str
    type: str
    fill: tuple[float, ...] = ()
    missing: bool = False
    vocabulary: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    note: str = ""

    @property
    def used(self) -> bool:
        """Whether the model takes the column: text only where asked for (it then has words)."""
        return self.type not in (IDENTIFIER, DROP) and (self.type != TEXT or bool(self.vocabulary))

    def feature_names(self) -> list[str]:
        """The names of the features the column becomes, in the encoding's order."""
        if self.type in (NUMBER, BOOLEAN):
            names = [self.name]
        elif self.type == CATEGORY:
            names = [f"{self.name}=(unseen)"] + [
                f"{self.name}={value or '(blank)'}" for value in self.vocabulary
            ]
        elif self.type == DATE:
            names = [f"{self.name}.{part}" for part in self.parts]
        elif self.type == TEXT and self.used:
            names = [f"{self.name}:(other words)"] + [f"{self.name}:{word}" for word in self.vocabulary]
        else:
            return []
        return names + ([f"{self.name}.missing"] if self.missing else [])

    def describe(self) -> str:
        """One short phrase for the banner: `island: category (3 values)`."""
        if self.type == CATEGORY:
            blank = ", blank is a value" if "" in self.vocabulary else ""
            return f"{self.name}: category ({len(self.vocabulary)} values{blank})"
        if self.type == TEXT and self.used:
            return f"{self.name}: text ({len(self.vocabulary)} words)"
        if self.type == DATE:
            what = f"date ({', '.join(self.parts)})"
        elif not self.used:
            return f"{self.name}: left out ({self.note})"
        else:
            what = self.type
        return f"{self.name}: {what}" + (f", blanks -> {_short(self.fill[0])} + missing" if self.missing else "")

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "fill": list(self.fill),
            "missing": self.missing,
            "vocabulary": list(self.vocabulary),
            "parts": list(self.parts),
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Column:
        """The column of `data` (inputs.json), every field of its type (ValueError otherwise)."""
        column = cls(
            name=str(data["name"]),
            type=str(data["type"]),
            fill=tuple(float(value) for value in data["fill"]),
            missing=bool(data["missing"]),
            vocabulary=tuple(str(value) for value in data["vocabulary"]),
            parts=tuple(str(part) for part in data["parts"]),
            note=str(data.get("note", "")),
        )
        if column.type not in COLUMN_TYPES or not set(column.parts) <= {*DATE_PARTS, "hour"}:
            raise ValueError(column.name)
        return column


def _packed(first: str, phrases: list[str], width: int) -> list[str]:
    """`phrases` joined by "; " after `first`, a new line (indented) where the next would pass `width`."""
    lines, line = [], first
    for phrase in phrases:
        fresh = line in (first, "  ")
        if not fresh and len(line) + len(phrase) + 2 > width:
            lines.append(line + ";")
            line = "  "
        elif not fresh:
            line += "; "
        line += phrase
    return [*lines, line]


def _short(value: float) -> str:
    return f"{value:.6g}"


@dataclasses.dataclass(frozen=True)
class TableSchema:
    """The columns of a table (in the file's order, the label's excepted) and its label:
    `classes` names a string label's classes (class id i is `classes[i]`), None otherwise."""

    columns: tuple[Column, ...]
    label: str
    classes: tuple[str, ...] | None = None
    dropped_rows: int = 0  # Rows left out: their label is blank.

    @property
    def used(self) -> tuple[Column, ...]:
        return tuple(column for column in self.columns if column.used)

    def feature_names(self) -> list[str]:
        return [name for column in self.used for name in column.feature_names()]

    def describe(self, width: int = 78) -> list[str]:
        """The lines the banner shows, none wider than `width` where words allow: the columns
        used, each column left out, the label's classes and the rows left out."""
        lines = _packed("columns: ", [column.describe() for column in self.used], width)
        lines += [column.describe() for column in self.columns if not column.used]
        if self.classes is not None:
            names = ", ".join(self.classes[:20]) + (", ..." if len(self.classes) > 20 else "")
            lines += textwrap.wrap(
                f"label {self.label!r}: {len(self.classes)} classes: {names}", width, subsequent_indent="  "
            )
        if self.dropped_rows:
            lines.append(f"{self.dropped_rows} rows left out: their label {self.label!r} is blank")
        return lines

    def as_json(self) -> dict[str, Any]:
        return {
            "columns": [column.as_json() for column in self.columns],
            "label": self.label,
            "classes": None if self.classes is None else list(self.classes),
            "dropped_rows": self.dropped_rows,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TableSchema:
        classes = data["classes"]
        return cls(
            columns=tuple(Column.from_json(column) for column in data["columns"]),
            label=str(data["label"]),
            classes=None if classes is None else tuple(str(name) for name in classes),
            dropped_rows=int(data.get("dropped_rows", 0)),
        )


def is_table_file(name: str) -> bool:
    return name.endswith((".csv", ".parquet"))


def read_frame(path: str, flag: str = "dataset") -> Any:
    """Every cell of `path` (.csv or .parquet) as text, a blank as "" (a pandas DataFrame of
    strings): one form whatever the file stored, so that one inference reads both."""
    import pandas as pd

    if not os.path.isfile(path):
        raise DataError(f"--{flag}={path} does not exist or is not a file")
    try:
        if path.endswith(".parquet"):
            frame = pd.read_parquet(path)
            frame = frame.astype(object).where(frame.notna(), "").map(_as_text)
        else:
            frame = pd.read_csv(
                path, dtype=str, keep_default_na=False, na_filter=False, encoding="utf-8-sig", index_col=False
            )
    except (OSError, ValueError, UnicodeDecodeError, ImportError) as error:  # ParserError is a ValueError.
        reason = " ".join(str(error).split())
        raise DataError(f"cannot read --{flag}={path}: {type(error).__name__}: {reason}") from None
    frame.columns = [str(name).strip() for name in frame.columns]
    duplicated = sorted({name for name in frame.columns if list(frame.columns).count(name) > 1})
    if duplicated:
        raise DataError(f"--{flag}={path} names column {duplicated[0]!r} twice; give every column its own name")
    if len(frame) == 0:
        raise DataError(f"--{flag}={path} needs a header row and at least one example row")
    return frame.apply(lambda series: series.str.strip())


def _as_text(value: Any) -> str:
    """A Parquet cell as a CSV would hold it: floats by their shortest round-trip form."""
    if isinstance(value, str):
        return value
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if hasattr(value, "isoformat") and not isinstance(value, (bool, np.bool_)):
        return str(value)
    return str(value)


def parse_column_types(entries: Sequence[str] | None) -> dict[str, str]:
    """`--column_types=name:type,...` as {name: type}; one line naming a bad entry."""
    types: dict[str, str] = {}
    for entry in entries or ():
        name, colon, kind = entry.rpartition(":")
        if not colon or not name.strip() or kind.strip() not in COLUMN_TYPES:
            raise DataError(
                f"--column_types entry {entry!r} is not NAME:TYPE with TYPE one of {', '.join(COLUMN_TYPES)} "
                "(e.g. --column_types=zip:category,id:drop)"
            )
        types[name.strip()] = kind.strip()
    return types


def infer_schema(train: Any, label: str, types: dict[str, str], where: str) -> tuple[TableSchema, list[str]]:
    """The schema of the training rows `train` (a DataFrame of text) and the problems that make
    it unusable (every one; empty when it is fine). `types`: the user's types by column."""
    problems = [
        f"--column_types names {name!r}, which is not a column" for name in types if name not in train.columns
    ]
    if types.get(label) is not None:
        problems.append(f"--column_types sets the label column {label!r}; set the features' types only")
    columns = []
    for name in train.columns:
        if name == label:
            continue
        column, problem = infer_column(train[name], name, types.get(name))
        columns.append(column)
        if problem:
            problems.append(problem)
    if columns and not any(column.used for column in columns) and not problems:
        shown = "; ".join(column.describe() for column in columns)
        problems.append(f"no column is left to learn from ({shown}); set a type with --column_types=NAME:TYPE")
    if not columns:
        problems.append(f"has no feature column besides {label!r}")
    return TableSchema(columns=tuple(columns), label=label), problems


def infer_column(cells: Any, name: str, asked: str | None) -> tuple[Column, str | None]:
    """One column's description from its training cells (text, "" blank), as `asked` or as
    inferred; and the problem that makes it unusable, if any."""
    if asked == DROP:
        return Column(name, DROP, note="dropped as --column_types asked"), None
    filled = cells[cells != ""]
    if len(filled) == 0:
        return Column(name, DROP, note="blank"), (
            f"column {name!r} is blank in every training row; fill it or drop it (--column_types={name}:drop)"
        )
    kind = asked or _inferred_type(filled, len(cells))
    blanks = len(filled) < len(cells)
    if kind == NUMBER:
        numbers = _as_numbers(filled)
        if numbers is None:
            bad = _strays(filled, _is_number)
            if asked == NUMBER:
                return Column(name, DROP), f"column {name!r} is set to number but holds {bad}"
            return Column(name, DROP), (
                f"column {name!r} holds numbers but also {bad}: leave a missing number's cell blank, or read "
                f"the column as categories (--column_types={name}:category)"
            )
        return Column(name, NUMBER, fill=(float(np.median(numbers)),), missing=blanks), None
    if kind == BOOLEAN:
        words = set(filled.str.lower())
        if not any(words <= pair for pair in _BOOLEAN_PAIRS):
            return Column(name, DROP), f"column {name!r} is set to boolean but holds {sorted(words)[:4]}"
        return Column(name, BOOLEAN, fill=(0.0,), missing=blanks), None
    if kind == DATE:
        return _date_column(name, filled, blanks)
    if kind == CATEGORY:
        counts = filled.value_counts() if not blanks else cells.value_counts()
        vocabulary = tuple(str(value) for value in sorted(counts.index, key=lambda v: (-counts[v], v)))
        if asked == CATEGORY and len(filled) > 1 and filled.nunique() == len(filled):
            return Column(name, DROP), (
                f"column {name!r} is set to category but its {len(filled)} training rows hold {len(filled)} "
                f"values, as many values as rows (nothing to learn from a value); drop it (--column_types="
                f"{name}:drop) or let it be read as an identifier"
            )
        return Column(name, CATEGORY, vocabulary=vocabulary), None
    if kind == IDENTIFIER:
        note = f"an identifier: {filled.nunique()} values in {len(cells)} rows"
        return Column(name, IDENTIFIER, note=note + ("" if asked is None else ", as --column_types asked")), None
    if asked == TEXT:
        vocabulary = tuple(text_vocabulary(filled.to_numpy(dtype=str), MAX_WORDS))
        if not vocabulary:
            return Column(name, DROP), f"column {name!r} is set to text but its training rows hold no word"
        return Column(name, TEXT, vocabulary=vocabulary), None
    note = f"free text; --column_types={name}:text reads its words"
    return Column(name, TEXT, note=note), None


def _inferred_type(filled: Any, rows: int) -> str:
    """The type of a column's non-blank training cells (`rows`: with its blanks). A column whose
    cells are MOSTLY numbers (or dates) is one of numbers (dates) with a few stray cells ('?',
    'n/a', a typo), which are then named as its problem: read as categories or an identifier,
    the column would be left out or lose its order, said only in passing."""
    if _as_numbers(filled) is None and _share(filled, _is_number) >= MOSTLY:
        return NUMBER
    if _as_numbers(filled) is not None:
        numbers = _as_numbers(filled)
        assert numbers is not None
        integral = bool(np.all(numbers == np.round(numbers)))
        span = float(numbers.max() - numbers.min()) + 1 if len(numbers) else 0.0
        if (
            integral
            and rows >= MIN_ROWS_TO_CALL_IDENTIFIER
            and len(np.unique(numbers)) == rows
            and span <= 2 * rows
        ):
            return IDENTIFIER  # 1, 2, 3, ...: a row number, not a quantity.
        return NUMBER
    lowered = set(filled.str.lower())
    if any(lowered <= pair for pair in _BOOLEAN_PAIRS) and len(lowered) == 2:
        return BOOLEAN
    if float(filled.str.match(_DATE).mean()) >= MOSTLY:
        return DATE  # (Nearly) every cell written as a date: one that does not parse is a problem, said.
    if rows >= MIN_ROWS_TO_CALL_IDENTIFIER and filled.nunique() >= IDENTIFIER_SHARE * len(filled):
        return TEXT if _words(filled) >= TEXT_WORDS else IDENTIFIER
    return CATEGORY


def _words(filled: Any) -> float:
    return float(filled.str.split().str.len().mean())


def _as_numbers(cells: Any) -> np.ndarray | None:
    """The cells as float64 (Python's float(): correctly rounded, as the numeric reader reads
    them), or None where one is no finite number."""
    values = [cells] if isinstance(cells, str) else list(cells)
    try:
        numbers = np.array([float(cell) for cell in values], dtype=np.float64)
    except ValueError:
        return None
    return numbers if np.isfinite(numbers).all() else None


def _is_number(cell: str) -> bool:
    try:
        return math.isfinite(float(cell))
    except ValueError:
        return False


def _first_bad(cells: Any, good: Any) -> str:
    return next(str(cell) for cell in cells if not good(cell))


def _share(cells: Any, good: Any) -> float:
    """The share of `cells` that are `good` (a cell at a time: for a column that is not all good)."""
    return sum(1 for cell in cells if good(cell)) / max(len(cells), 1)


def _strays(cells: Any, good: Any) -> str:
    """`'?' (12 rows), 'n/a' (3 rows)`: the cells that are not `good`, the most frequent first
    (three at most, then how many other values)."""
    counts = cells[[not good(cell) for cell in cells]].value_counts()
    shown = ", ".join(
        f"{value!r} ({count} row{'' if count == 1 else 's'})" for value, count in counts[:3].items()
    )
    return shown + (f" and {len(counts) - 3} other values" if len(counts) > 3 else "")


def _dates(cells: Any) -> Any:
    """The cells as pandas datetimes, or None where one does not parse as an ISO 8601 date."""
    import pandas as pd

    if not bool(cells.str.match(_DATE).all()):
        return None
    parsed = pd.to_datetime(cells, format="ISO8601", errors="coerce")
    return None if parsed.isna().any() else parsed


def _date_column(name: str, filled: Any, blanks: bool) -> tuple[Column, str | None]:
    parsed = _dates(filled)
    if parsed is None:
        bad = _first_bad(filled, lambda cell: _dates(_series([cell])) is not None)
        return Column(name, DROP), (
            f"column {name!r} holds {bad!r}, which is not a date (write dates as 2024-03-01 or 2024-03-01 13:45)"
        )
    parts = date_parts(parsed)
    names = [*DATE_PARTS] + (["hour"] if bool((parts["hour"] != 0).any()) else [])
    fill = tuple(float(np.median(parts[part])) for part in names)
    return Column(name, DATE, fill=fill, missing=blanks, parts=tuple(names)), None


def _series(values: list[str]) -> Any:
    import pandas as pd

    return pd.Series(values, dtype=object)


def date_parts(parsed: Any) -> dict[str, np.ndarray]:
    """The parts of pandas datetimes a model can use, as float64 (Monday is day 0)."""
    return {
        "year": parsed.dt.year.to_numpy(np.float64),
        "month": parsed.dt.month.to_numpy(np.float64),
        "day": parsed.dt.day.to_numpy(np.float64),
        "day_of_week": parsed.dt.dayofweek.to_numpy(np.float64),
        "hour": parsed.dt.hour.to_numpy(np.float64),
    }


def check_cells(frame: Any, schema: TableSchema, where: str) -> list[str]:
    """The problems of rows read by `schema` that the training rows did not have: a number or
    date column's cell that is none (every such column, its first bad cell)."""
    problems = []
    for column in schema.used:
        if column.name not in frame.columns:
            continue
        filled = frame[column.name][frame[column.name] != ""]
        if column.type == NUMBER and _as_numbers(filled) is None:
            bad = _first_bad(filled, lambda cell: _as_numbers(cell) is not None)
            problems.append(f"column {column.name!r} holds {bad!r}, not a number, in {where}")
        elif column.type == DATE and len(filled) and _dates(filled) is None:
            bad = _first_bad(filled, lambda cell: _dates(_series([cell])) is not None)
            problems.append(f"column {column.name!r} holds {bad!r}, which is not a date, in {where}")
    return problems


def raw_columns(frame: Any, schema: TableSchema) -> dict[str, np.ndarray]:
    """The columns the model takes, as its inputs take them: numbers float32 (a blank NaN),
    everything else text; each (N, 1)."""
    arrays = {}
    for column in schema.used:
        cells = frame[column.name].to_numpy(dtype=object)
        if column.type == NUMBER:
            values = np.array([float(cell) if cell != "" else np.nan for cell in cells], dtype=np.float32)
        else:
            values = cells.astype(str)
        arrays[column.name] = values.reshape(-1, 1)
    return arrays


def text_vocabulary(cells: Any, most: int) -> list[str]:
    """The `most` most frequent words of `cells` as a text column's layer reads them (lower case,
    without punctuation), by Keras's own `TextVectorization.adapt` (imported here: reading a
    table's types imports no TensorFlow until a column is asked to be text)."""
    import keras
    import tensorflow as tf

    words = keras.layers.TextVectorization(max_tokens=most + 1, **TEXT_LAYER)
    words.adapt(tf.constant(cells))
    return [str(word) for word in words.get_vocabulary()[1:]]  # Not its unknown-word bucket.
