r"""Reading a table for `--dataset=PATH.csv`: numpy's reader (what `input.files.read_table`
uses) against reading every cell in Python (the csv module and float(), the reader before
it and still the one that names a bad cell), in time and in memory.

    python -m benchmarks.csv_read --rows=500000 --columns=12 --json=benchmarks/out/csv_read.json

Writes one CSV of `--rows` rows of `--columns` numbers (the last an integer label) to a
temporary directory, then reads it `--repeats` times with each reader, alternately, each
time in a fresh process: its wall time and the growth of its peak resident memory over
what the imports took. Prints one JSON object with the medians and their ratios
(python_cells / numpy: how many times faster and smaller numpy's reader is).
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np
from absl import app, flags

from benchmarks.fresh_process import measure_in_fresh_process, report

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The flags, defined when run as a program: the test imports this module beside others' flags."""
    flags.DEFINE_integer("rows", 500_000, "Example rows of the table.")
    flags.DEFINE_integer("columns", 12, "Columns, the label last.")
    flags.DEFINE_integer("repeats", 3, "Reads with each reader, alternately.")
    flags.DEFINE_string("json", None, "Also write the result here.")


# Run in a fresh process: the peak memory of one read, over the imports'.
_READ = """
import json, resource, sys, time
from input import files
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.perf_counter()
if sys.argv[2] == "numpy":
    _, features, labels = files.read_table(sys.argv[1], "label")
else:
    header, rows = files._numbered_rows(sys.argv[1], "dataset")
    values = files._numbers(sys.argv[1], "dataset", header, rows, list(range(len(header))))
seconds = time.perf_counter() - began
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": seconds, "peak_mib": grown / 1024}))
"""


def write_table(path: str, rows: int, columns: int) -> int:
    """A CSV like a user's: decimals written with 6 digits, an integer label; its size in bytes."""
    generator = np.random.default_rng(0)
    features = generator.normal(size=(rows, columns - 1))
    labels = generator.integers(0, 10, size=rows)
    header = ",".join([*(f"f{i}" for i in range(columns - 1)), "label"])
    body = np.column_stack([features, labels])
    np.savetxt(path, body, delimiter=",", header=header, comments="", fmt=["%.6f"] * (columns - 1) + ["%d"])
    return os.path.getsize(path)


def read_once(path: str, reader: str) -> dict[str, float]:
    return measure_in_fresh_process(_READ, path, reader, timeout=600)


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "table.csv")
        size = write_table(path, FLAGS.rows, FLAGS.columns)
        runs: dict[str, list[dict[str, float]]] = {"numpy": [], "python_cells": []}
        for _ in range(FLAGS.repeats):
            for reader in runs:
                runs[reader].append(read_once(path, reader))
    result: dict[str, object] = {
        "rows": FLAGS.rows,
        "columns": FLAGS.columns,
        "file_mib": round(size / 2**20, 1),
    }
    # Seconds to the microsecond: a small table's read takes under a millisecond, which three
    # decimals wrote as 0 (and a ratio of 0 or a division by zero).
    medians = {
        reader: {key: statistics.median(run[key] for run in measured) for key in ("seconds", "peak_mib")}
        for reader, measured in runs.items()
    }
    for reader, median in medians.items():
        result[reader] = {"seconds": round(median["seconds"], 6), "peak_mib": round(median["peak_mib"], 3)}
    numpy, cells = medians["numpy"], medians["python_cells"]
    result["time_ratio"] = round(cells["seconds"] / max(numpy["seconds"], 1e-6), 2)
    result["memory_ratio"] = round(cells["peak_mib"] / max(numpy["peak_mib"], 1e-3), 2)
    report(result, FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main)
