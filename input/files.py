"""A user's own data in one file, with no code: `--dataset=PATH.npz` or `--dataset=PATH.csv`.

.npz: the layout of `keras.datasets` files, arrays `x_train`, `y_train` and
optionally `x_test`, `y_test`. .csv: a header row, one example a row, numeric
feature columns and the `--label_column`; the eval split from `--eval_file`
(the same columns) or `--eval_fraction`. Both are read into memory whole.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np

from input.arrays import source_from_arrays, split_off_eval
from input.errors import DataError
from input.in_memory import InMemorySource

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


class CellError(DataError):
    """A cell that is no number (text, or blank): the table is read with its types instead
    (`input.table_source`), where a reader of numbers alone names the cell."""


def is_file_dataset(name: str) -> bool:
    return name.endswith((".npz", ".csv", ".parquet"))


def load_npz(
    path: str, *, eval_fraction: float, label_kind: str | None, num_classes: int | None
) -> InMemorySource:
    """x_train/y_train, and x_test/y_test as the eval split if present (else `eval_fraction`)."""
    arrays = _read_npz(path)
    missing = [key for key in ("x_train", "y_train") if key not in arrays]
    if missing:
        raise DataError(
            f"--dataset={path} holds {sorted(arrays)} but no {' or '.join(missing)}; an .npz data set needs "
            "x_train and y_train (and optionally x_test, y_test), as keras.datasets files do"
        )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"--dataset={path} has only one of x_test and y_test; give both or neither")
    for features, labels in (("x_train", "y_train"), ("x_test", "y_test")):
        if features in arrays:  # Before anything indexes them (the eval split is taken by index).
            _check_npz_pair(path, features, arrays[features], labels, arrays[labels])
    train = (arrays["x_train"], arrays["y_train"])
    if "x_test" in arrays:
        eval_split: tuple[np.ndarray, np.ndarray] | None = (arrays["x_test"], arrays["y_test"])
    else:
        train, eval_split = split_off_eval(*train, eval_fraction, path)
    return source_from_arrays(
        os.path.basename(path), train, eval_split, label_kind=label_kind, num_classes=num_classes
    )


_NOT_NUMBERS = {"U": "strings", "S": "byte strings", "O": "Python objects", "M": "dates", "m": "time spans"}


def _check_npz_pair(path: str, x: str, features: np.ndarray, y: str, labels: np.ndarray) -> None:
    """One split's arrays as the engine reads them, named in the message: numbers (not complex,
    not strings), features (N, ...) and labels (N,) or (N, k), one label an example, and
    examples that hold values (an (N, 0) array aborted the process inside oneDNN)."""
    for name, array in ((x, features), (y, labels)):
        kind = array.dtype.kind
        if kind == "c":
            raise DataError(
                f"--dataset={path}: {name} holds complex numbers ({array.dtype}), which would train as their "
                f"real part alone; store the real and imaginary parts as separate values "
                f"(np.stack([{name}.real, {name}.imag], axis=-1))"
            )
        if kind not in "biuf":
            what = _NOT_NUMBERS.get(kind, "values")
            raise DataError(f"--dataset={path}: {name} holds {what} ({array.dtype}), not numbers; store numbers")
    if features.ndim < 2:
        hint = f" (one value an example: {x}[:, None])" if features.ndim == 1 else ""
        raise DataError(
            f"--dataset={path}: {x} has shape {features.shape}; it must be (N, ...), one example a row{hint}"
        )
    if labels.ndim not in (1, 2):
        raise DataError(f"--dataset={path}: {y} has shape {labels.shape}; labels must be (N,) or (N, k)")
    if len(features) != len(labels):
        raise DataError(
            f"--dataset={path}: {x} holds {len(features)} examples but {y} {len(labels)} labels; give one each"
        )
    for name, array in ((x, features), (y, labels)):
        if 0 in array.shape[1:]:
            raise DataError(f"--dataset={path}: {name} has shape {array.shape}: its examples hold no values")


def check_npz_sizes(path: str, members: tuple[str, ...], where: str = "", limit: int | None = None) -> None:
    """Refuse an .npz whose `members` (array names) would inflate past `limit` bytes (by default
    half the memory this process may use), before any is read: a few MB of zeros can declare
    GiBs, which numpy allocates whole (a MemoryError traceback, or the machine swapping). Each
    member is measured by its size in the zip directory and by its .npy header's shape and
    dtype, whichever is larger. A file that is no zip is left to the reader to name. `where`
    names the file in the message (`--dataset=PATH` by default)."""
    if limit is None:
        from engine.cli.process.host_memory import memory_limit_bytes

        memory = memory_limit_bytes()
        if memory is None:
            return
        limit = memory // 2
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                if name not in members:
                    continue
                size = max(info.file_size, _declared_bytes(archive, info))
                total += size
                if total > limit:
                    raise DataError(_too_large(where or f"--dataset={path}", info, size, total, limit))
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError):
        return  # Not a zip, or a damaged one: the reader names it.


def _too_large(where: str, info: zipfile.ZipInfo, size: int, total: int, limit: int) -> str:
    together = "" if total == size else f" ({_size(total, exact=False)} with the arrays before it)"
    return (
        f"{where}: {info.filename} inflates to {_size(size)} from {_size(info.compress_size)} in the "
        f"file{together}, more than the {_size(limit)} it may take here (half the memory this process "
        "may use); use a smaller array or a machine with more memory"
    )


def _declared_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """The bytes an .npy member's header says its array holds (0 where it has no readable header)."""
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                return 0
            shape, _, dtype = read[version](member)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError):
        return 0
    return math.prod(shape) * dtype.itemsize


def _size(count: int, exact: bool = True) -> str:
    """A byte count as people read it: '4.0 GiB (4294967296 bytes)', or '4.0 GiB' not `exact`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}" + (f" ({count} bytes)" if exact else "")
    return f"{count} bytes"


def _read_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise DataError(f"--dataset={path} does not exist or is not a file")
    check_npz_sizes(path, NPZ_KEYS)
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise DataError(f"--dataset={path} is a single .npy array, not an .npz of named arrays")
            arrays = {}
            for key in data.files:
                if key in NPZ_KEYS:
                    try:
                        arrays[key] = data[key]
                    except ValueError as error:
                        if "allow_pickle" not in str(error):
                            raise
                        raise DataError(
                            f"--dataset={path}: {key} holds Python objects (dtype object), which are never "
                            "loaded (that could run code); store numbers"
                        ) from None
            return arrays
    except DataError:
        raise
    except MemoryError:  # Measured above; what else is in memory may still leave too little.
        raise DataError(f"--dataset={path} does not fit in the memory left to this process") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise DataError(
            f"cannot read --dataset={path}: {type(error).__name__}: {error}; write it with "
            "np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
        ) from None


def load_csv(
    path: str,
    *,
    label_column: str | None,
    eval_file: str | None,
    eval_fraction: float,
    label_kind: str | None,
    num_classes: int | None,
    column_types: list[str] | None = None,
) -> InMemorySource:
    """Feature columns (every column but the label) as float32, in the header's order, where
    every cell is a number and no --column_types is given; any other table by its columns'
    types (`input.table_source`)."""
    if not label_column:
        raise DataError(f"--dataset={path} needs --label_column=NAME, the column that holds the labels")
    table: dict[str, Any] = {
        "label_column": label_column,
        "eval_file": eval_file,
        "eval_fraction": eval_fraction,
        "label_kind": label_kind,
        "num_classes": num_classes,
    }
    if not column_types and not (eval_file or "").endswith(".parquet"):
        try:
            return _load_numbers(path, **table)
        except CellError:
            pass  # Text or blanks: read by the columns' types.
    from input.table_source import load_table

    return load_table(path, **table, column_types=column_types)


def _load_numbers(
    path: str,
    *,
    label_column: str,
    eval_file: str | None,
    eval_fraction: float,
    label_kind: str | None,
    num_classes: int | None,
) -> InMemorySource:
    """A CSV of numbers alone: every column but the label a feature, as float32."""
    columns, features, labels = read_table(path, label_column)
    assert labels is not None, "read_table gives labels with a label column"
    eval_split: tuple[np.ndarray, np.ndarray] | None
    if eval_file:
        eval_columns, eval_features, eval_labels = read_table(eval_file, label_column, flag="eval_file")
        assert eval_labels is not None, "read_table gives labels with a label column"
        if eval_columns != columns:
            raise DataError(
                f"--eval_file={eval_file} has the feature columns {eval_columns}, --dataset={path} has "
                f"{columns}; give both files the same columns"
            )
        train, eval_split = (features, labels), (eval_features, eval_labels)
    else:
        train, eval_split = split_off_eval(features, labels, eval_fraction, path)
    return source_from_arrays(
        os.path.basename(path), train, eval_split, label_kind=label_kind, num_classes=num_classes
    )


def read_table(
    path: str, label_column: str | None, flag: str = "dataset"
) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """(feature column names, features (N, F) float32, labels (N,) or None without a
    label column): every cell a number, or one line naming the row and column."""
    header = read_header(path, flag)
    if label_column is not None and label_column not in header:
        raise DataError(f"--{flag}={path} has no column {label_column!r}; its columns are {header}")
    values = read_numbers(path, flag, header)
    if label_column is None:
        return header, values.astype(np.float32), None
    index = header.index(label_column)
    names = [name for name in header if name != label_column]
    column = values[:, index]
    # Class ids are written as integers ("3"); "3.0" or "151.5" are values to regress.
    as_integers = bool(np.isfinite(column).all() and np.all(column == np.round(column))) and all(
        _is_integer_text(cell.strip()) for cell in _column_text(path, index)
    )
    labels = column.astype(np.int64) if as_integers else column.copy()
    features = np.delete(values, index, axis=1).astype(np.float32)
    if features.shape[1] == 0:
        raise DataError(f"--{flag}={path} has no feature column besides {label_column!r}")
    return names, features, labels


def read_columns(path: str, names: list[str], *, flag: str) -> tuple[np.ndarray, list[str]]:
    """(the columns `names` of `path` by header name, in that order, as float32 (N, len(names));
    the names of its other columns, which are not read). A missing column is one line naming it."""
    header = read_header(path, flag)
    missing = [name for name in names if name not in header]
    if missing:
        raise DataError(
            f"--{flag}={path} has no column {missing[0]!r}"
            + (f" (nor {', '.join(repr(name) for name in missing[1:4])})" if len(missing) > 1 else "")
            + f"; the model was trained on the columns {names}, found {header}"
        )
    wanted = [header.index(name) for name in names]
    values = read_numbers(path, flag, header, wanted)
    return values.astype(np.float32), [name for name in header if name not in names]


def csv_header(path: str, flag: str = "dataset") -> list[str]:
    """The column names of `path`'s header row (as `read_table` names them), reading that row only."""
    with _past_header(path, flag) as (header, _, _):
        return header


@contextlib.contextmanager
def _past_header(path: str, flag: str) -> Iterator[tuple[list[str], TextIO, Any]]:
    """(the header's column names, `path` open just past the header, the csv reader that read
    it): the header is the first record as the csv module parses it, which may span several
    lines (a quoted newline in a name), so every reader of the rows starts where it ends, never
    a line count after the top."""
    try:
        handle = open(path, newline="", encoding="utf-8-sig")  # -sig: a spreadsheet's BOM is not a name.
    except OSError as error:
        raise DataError(f"cannot read --{flag}={path}: {error}") from None
    with handle:
        try:
            reader = csv.reader(handle)
            header = [name.strip() for name in next(reader, [])]
        except (OSError, UnicodeDecodeError, csv.Error) as error:
            raise DataError(f"cannot read --{flag}={path}: {error}") from None
        yield header, handle, reader


def read_header(path: str, flag: str) -> list[str]:
    """The header's column names, each once (a spreadsheet's BOM is not part of the first)."""
    if not os.path.isfile(path):
        raise DataError(f"--{flag}={path} does not exist or is not a file")
    header = csv_header(path, flag)
    seen: dict[str, int] = {}
    for column, name in enumerate(header, start=1):
        if name in seen:  # Which copy would a name pick? csv keeps both; a model would train on one.
            raise DataError(
                f"--{flag}={path} names column {name!r} twice (columns {seen[name]} and {column}); give every "
                "column its own name"
            )
        seen[name] = column
    return header


def read_numbers(path: str, flag: str, header: list[str], columns: list[int] | None = None) -> np.ndarray:
    """The example rows' cells of `columns` (indices into `header`; all by default) as float64
    (N, len(columns)). numpy's reader does the work (half the time and a quarter of the memory
    of reading cells one by one in Python: benchmarks/csv_read.py) where every column is
    numeric; otherwise `read_rows` and `_numbers` read the cells, and name the line and column
    of a bad one."""
    try:
        with _past_header(path, flag) as (_, body, _), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Blank lines, or no row at all: said below.
            values = np.loadtxt(body, delimiter=",", dtype=np.float64, ndmin=2, comments=None, quotechar='"')
    except (ValueError, UnicodeDecodeError, OSError, DataError):
        values = None
    wanted = list(range(len(header))) if columns is None else columns
    if values is None or values.shape[0] == 0 or values.shape[1] != len(header):
        # A bad cell or row (named in one line), or a column not read that is not numeric (an id):
        # every row is still checked to have a cell under every column (a stray comma shifts them).
        _, rows = _numbered_rows(path, flag)
        return _numbers(path, flag, header, rows, wanted)
    return values if columns is None else values[:, columns]


def read_rows(path: str, flag: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names (each once) and the example rows of a CSV file, as text."""
    header, rows = _numbered_rows(path, flag)
    return header, [row for _, row in rows]


def _numbered_rows(path: str, flag: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The header's column names (each once) and the example rows, each with the line it starts
    on in the file (a quoted newline makes a record longer than a line)."""
    header = read_header(path, flag)
    rows: list[tuple[int, list[str]]] = []
    try:
        with _past_header(path, flag) as (_, _, reader):
            line = reader.line_num + 1
            for row in reader:  # line_num counts the lines read: the header's lines first.
                if row:
                    rows.append((line, row))
                line = reader.line_num + 1
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"cannot read --{flag}={path}: {error}; save it as UTF-8 text") from None
    if not rows:
        raise DataError(f"--{flag}={path} needs a header row and at least one example row")
    return header, rows


def _column_text(path: str, index: int) -> list[str]:
    """The cells of column `index` as written (for "3" against "3.0"): one column, by numpy's
    reader, or by the csv module's where numpy refuses a cell Python's float() took."""
    try:
        with _past_header(path, "dataset") as (_, body, _), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Blank lines.
            return list(
                np.loadtxt(
                    body, delimiter=",", usecols=[index], dtype=str, ndmin=1, comments=None, quotechar='"'
                )
            )
    except ValueError:
        _, rows = read_rows(path, "dataset")
        return [row[index] for row in rows]


def _numbers(
    path: str, flag: str, header: list[str], rows: list[tuple[int, list[str]]], columns: list[int]
) -> np.ndarray:
    """The cells of `columns` (indices into `header`) as float64 (N, len(columns)); every row must
    have a cell under every column, and those read must be numbers."""
    values = np.empty((len(rows), len(columns)), dtype=np.float64)
    for example, (line, row) in enumerate(rows):
        if len(row) != len(header):
            raise DataError(f"--{flag}={path} line {line} has {len(row)} values under {len(header)} columns")
        for position, column in enumerate(columns):
            cell = row[column]
            try:
                values[example, position] = float(cell)
            except ValueError:
                what = (
                    "is empty (a missing value: fill or drop that row)"
                    if not cell.strip()
                    else f"{cell!r} is not a number; every column must be numeric (encode categories first)"
                )
                raise CellError(f"--{flag}={path} line {line}, column {header[column]!r} {what}") from None
    return values


def _is_integer_text(cell: str) -> bool:
    return cell.lstrip("+-").isdigit()
