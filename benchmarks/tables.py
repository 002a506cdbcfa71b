r"""Tables as they come, from the command line with no tuning, against scikit-learn's
`HistGradientBoosting` on the same split (it takes categories and blanks natively).

    python -m benchmarks.tables --json=benchmarks/results/issue50/tables.json

Each table is split once (a fixed permutation, a fifth held out) into train.csv and
eval.csv, written with its text, blanks and dates as they are. The engine trains from
`python -m engine.main --dataset=train.csv --eval_file=eval.csv --label_column=NAME
--model=mlp` (nothing else: each column's type inferred, the run's default length) and its
final evaluation (metrics.json) is read; `HistGradientBoostingClassifier/Regressor
(categorical_features="from_dtype", random_state=0)` fits the same rows: text columns as
pandas categories, numbers with their blanks (NaN), dates as year, month, day and day of
week, and the columns the engine leaves out (identifiers, free text) left out too. Prints
one line a table and a JSON object: accuracy for a class label, MAE for a value.

The tables: two the tests make (`mixed_table`: numbers with blanks, a text category with
blanks, a yes/no column, a date, a row id and a free-text column; a class label and a
value), and public ones shipped in packages offline: scikit-learn's iris (its species
names as the label), palmerpenguins' penguins, and vega_datasets' cars and seattle
weather (where those packages are installed; `pip install palmerpenguins vega_datasets`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
from absl import app, flags

from engine.lean_imports import import_tensorflow_lean

FLAGS = flags.FLAGS
HELD_OUT = 0.2
SPLIT_SEED = 50
_WORDS = "the a quick slow red blue cat dog runs jumps over under big small old new".split()


def define_flags() -> None:
    flags.DEFINE_string("json", None, "Also write the results here.")
    flags.DEFINE_list("tables", None, "Only these tables (default: all that load here).")
    flags.DEFINE_list("engine_flags", [], "Flags added to every engine run (default: none).")


def mixed_table(rows: int, seed: int = 0, label: str = "classes") -> Any:
    """A table of every column type, as a CSV export would hold it (blanks as ""): `age`
    (numbers, a tenth blank), `colour` (4 values and blanks), `member` (yes/no), `joined` (a
    date; weekends matter), `id` (a row id), `note` (free text, no signal), and `label`:
    class names low/mid/high by the score's tertiles, or the score itself (`label="values"`)."""
    import pandas as pd

    random = np.random.RandomState(seed)
    age = random.normal(40, 12, rows)
    colour = random.choice(["red", "green", "blue", "amber"], rows)
    member = random.rand(rows) < 0.4
    days = random.randint(0, 6 * 365, rows)
    joined = pd.Timestamp("2015-01-01") + pd.to_timedelta(days, unit="D")
    effect = {"red": 1.0, "green": -1.0, "blue": 0.0, "amber": 0.5}
    score = (
        (age - 40) / 12
        + np.array([effect[c] for c in colour])
        + 0.8 * member
        + 1.2 * (joined.dayofweek >= 5)
        + 0.3 * (joined.year - 2017)
        + random.normal(0, 0.3, rows)
    )
    ages = [f"{value:.1f}" for value in age]
    colours = list(colour)
    for index in random.choice(rows, rows // 10, replace=False):
        ages[index] = ""
    for index in random.choice(rows, rows // 20, replace=False):
        colours[index] = ""
    frame = pd.DataFrame(
        {
            "id": [f"row{index:05d}" for index in range(rows)],
            "age": ages,
            "colour": colours,
            "member": np.where(member, "yes", "no"),
            "joined": joined.strftime("%Y-%m-%d"),
            "note": [" ".join(random.choice(_WORDS, 5)) for _ in range(rows)],
        }
    )
    if label == "values":
        frame["label"] = [f"{value:.3f}" for value in 10 * score + 50]
    else:
        low, high = np.quantile(score, [1 / 3, 2 / 3])
        frame["label"] = np.where(score < low, "low", np.where(score < high, "mid", "high"))
    return frame


def _iris() -> Any:
    from sklearn.datasets import load_iris

    data = load_iris(as_frame=True)
    frame = data.frame.drop(columns="target")
    frame["species"] = data.target_names[data.target]
    return frame, "species"


def _penguins() -> Any:
    import palmerpenguins

    return palmerpenguins.load_penguins(), "species"


def _cars() -> Any:
    from vega_datasets import data

    frame = data.cars()
    frame["Year"] = frame["Year"].dt.strftime("%Y-%m-%d")
    return frame, "Miles_per_Gallon"


def _weather() -> Any:
    from vega_datasets import data

    frame = data.seattle_weather()
    frame["date"] = frame["date"].dt.strftime("%Y-%m-%d")
    return frame, "weather"


TABLES = {
    "mixed_classes": lambda: (mixed_table(2000, 1), "label"),
    "mixed_values": lambda: (mixed_table(2000, 2, label="values"), "label"),
    "iris": _iris,
    "penguins": _penguins,
    "cars": _cars,
    "seattle_weather": _weather,
}


def split(frame: Any) -> tuple[Any, Any]:
    order = np.random.RandomState(SPLIT_SEED).permutation(len(frame))
    held = int(round(len(frame) * HELD_OUT))
    return frame.iloc[order[held:]], frame.iloc[order[:held]]


def engine_score(train: Any, held: Any, label: str, directory: str, extra: list[str]) -> tuple[float, dict]:
    """The engine's final eval metric (accuracy or MAE) and its schema, from the command line."""
    train.to_csv(os.path.join(directory, "train.csv"), index=False)
    held.to_csv(os.path.join(directory, "eval.csv"), index=False)
    model_dir = os.path.join(directory, "run")
    command = [
        sys.executable,
        "-m",
        "engine.main",
        f"--dataset={directory}/train.csv",
        f"--eval_file={directory}/eval.csv",
        f"--label_column={label}",
        "--model=mlp",
        f"--model_dir={model_dir}",
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    with open(os.path.join(model_dir, "metrics.json")) as handle:
        metrics = json.load(handle)["eval"]
    with open(os.path.join(model_dir, "inputs.json")) as handle:
        schema = json.load(handle)["table"]
    return float(metrics["accuracy"] if "accuracy" in metrics else metrics["mae"]), schema


def baseline_score(train: Any, held: Any, label: str, schema: dict | None) -> float:
    """HistGradientBoosting on the same rows: the columns the engine used, text as categories."""
    import pandas as pd
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    types = {c["name"]: c["type"] for c in schema["columns"]} if schema else {}

    def prepared(frame: Any) -> Any:
        columns = {}
        for name in frame.columns:
            kind = types.get(name, "number")
            cells = frame[name].astype(str).where(frame[name].notna(), "")
            if name == label or kind in ("identifier", "text", "drop"):
                continue
            if kind == "date":
                dates = pd.to_datetime(cells.where(cells != ""), format="ISO8601")
                columns.update({f"{name}.year": dates.dt.year, f"{name}.month": dates.dt.month})
                columns.update({f"{name}.day": dates.dt.day, f"{name}.dow": dates.dt.dayofweek})
            elif kind in ("category", "boolean"):
                categories = sorted(set(train[name].astype(str).where(train[name].notna(), "")))
                columns[name] = pd.Categorical(cells, categories=categories)
            else:
                columns[name] = pd.to_numeric(frame[name].replace("", np.nan), errors="coerce")
        return pd.DataFrame(columns, index=frame.index)

    train = train[train[label].notna() & (train[label].astype(str) != "")]
    held = held[held[label].notna() & (held[label].astype(str) != "")]
    classes = schema is not None and schema.get("classes") is not None
    model_class = HistGradientBoostingClassifier if classes else HistGradientBoostingRegressor
    model = model_class(categorical_features="from_dtype", random_state=0)
    target = train[label].astype(str) if classes else pd.to_numeric(train[label])
    model.fit(prepared(train), target)
    predicted = model.predict(prepared(held))
    if classes:
        return float(np.mean(predicted == held[label].astype(str).to_numpy()))
    return float(np.mean(np.abs(predicted - pd.to_numeric(held[label]).to_numpy())))


def compare(name: str, extra: list[str]) -> dict[str, Any]:
    frame, label = TABLES[name]()
    train, held = split(frame)
    with tempfile.TemporaryDirectory() as directory:
        engine, schema = engine_score(train, held, label, directory, extra)
    baseline = baseline_score(train, held, label, schema)
    metric = "accuracy" if schema.get("classes") is not None else "mae"
    row = {
        "table": name,
        "rows": len(frame),
        "metric": metric,
        "engine": engine,
        "hist_gradient_boosting": baseline,
    }
    row["difference"] = engine - baseline if metric == "accuracy" else engine / baseline - 1
    row["types"] = {c["name"]: c["type"] for c in schema["columns"]}
    return row


def main(argv: list[str]) -> None:
    del argv
    import_tensorflow_lean()
    results = []
    for name in FLAGS.tables or list(TABLES):
        try:
            row = compare(name, FLAGS.engine_flags)
        except ImportError as error:
            print(f"{name}: skipped ({error})")
            continue
        results.append(row)
        shown = f"{row['difference']:+.3f}" if row["metric"] == "accuracy" else f"{row['difference']:+.1%}"
        print(
            f"{name}: {row['rows']} rows, {row['metric']} engine {row['engine']:.4f} "
            f"hist_gradient_boosting {row['hist_gradient_boosting']:.4f} ({shown})",
            flush=True,
        )
    print(json.dumps(results, indent=1))
    if FLAGS.json:
        os.makedirs(os.path.dirname(FLAGS.json) or ".", exist_ok=True)
        with open(FLAGS.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
