"""A table as it comes, from the command line: text, blanks, dates, a row id and named classes
train on two replicas, `--mode=eval` and `--mode=predict` read the raw rows (columns in any
order, no label) as training did, and the SavedModel and the `.keras` file beside it take
the raw columns and answer as predict does.

Covers: engine/cli/run/table_predict.py, engine/cli/run/table_export.py,
engine/cli/run/inputs_record.py.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from helpers import main_in_process, one_error_line

from benchmarks.tables import mixed_table

pytestmark = pytest.mark.slow
FLAGS = [
    "--label_column=label",
    "--model=mlp",
    "--global_batch_size=32",
    "--cpu_devices=2",
    "--strategy=mirrored",
]


def test_a_mixed_table_trains_predicts_and_serves_in_its_own_terms(tmp_path) -> None:
    mixed_table(400, seed=5).to_csv(tmp_path / "train.csv", index=False)
    model_dir, export_dir = tmp_path / "run", tmp_path / "export"
    common = [f"--dataset={tmp_path / 'train.csv'}", *FLAGS, f"--model_dir={model_dir}"]
    result = main_in_process(*common, "--train_steps=60", "--steps_per_loop=20", f"--export_dir={export_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "columns: age: number, blanks -> " in result.stderr
    assert "id: left out (an identifier: 360 values in 360 rows)" in result.stderr
    record = json.loads((model_dir / "inputs.json").read_text())
    assert record["table"]["classes"] == ["high", "low", "mid"]
    types = {column["name"]: column["type"] for column in record["table"]["columns"]}
    assert types == {
        "id": "identifier",
        "age": "number",
        "colour": "category",
        "member": "boolean",
        "joined": "date",
        "note": "text",
    }
    trained = json.loads((model_dir / "metrics.json").read_text())["eval"]["accuracy"]
    assert trained > 0.6  # Three classes: 1/3 by chance.
    evaluated = main_in_process(*common, "--mode=eval")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((model_dir / "metrics.json").read_text())["eval"]["accuracy"] == pytest.approx(trained)

    rows = mixed_table(50, seed=9)
    rows.loc[0, "colour"] = "violet"  # Unseen in training.
    shuffled = rows[["note", "joined", "member", "colour", "age", "id"]]  # No label, another order.
    shuffled.to_csv(tmp_path / "rows.csv", index=False)
    output = tmp_path / "out.csv"

    def predict(rows, to):
        return main_in_process(*common, "--mode=predict", f"--predict_input={rows}", f"--predict_output={to}")

    predicted = predict(tmp_path / "rows.csv", output)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    table = pd.read_csv(output)
    assert list(table.columns) == ["label", "high", "low", "mid"] and len(table) == 50
    probabilities = table[["high", "low", "mid"]].to_numpy()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-6)
    assert list(table["label"]) == [["high", "low", "mid"][i] for i in probabilities.argmax(axis=1)]

    shuffled.drop(columns=["joined", "colour"]).to_csv(tmp_path / "short.csv", index=False)
    refused = predict(tmp_path / "short.csv", tmp_path / "x.csv")
    assert refused.returncode == 2 and not (tmp_path / "x.csv").exists()
    assert "cannot be predicted: it has no column 'colour', 'joined'" in one_error_line(refused)
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 13), np.float32))
    refused = predict(tmp_path / "x.npz", tmp_path / "x.csv")
    assert "give it rows as a .csv or .parquet file" in one_error_line(refused)

    served = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    columns = {name: tf.constant(rows[name].astype(str).to_numpy()) for name in ("colour", "member", "joined")}
    columns["age"] = tf.constant(pd.to_numeric(rows["age"].replace("", np.nan)).to_numpy(np.float32))
    answer = served(**columns)
    np.testing.assert_allclose(answer["probabilities"].numpy(), probabilities, rtol=1e-4, atol=1e-5)
    assert [name.decode() for name in answer["classes"].numpy()] == list(table["label"])

    import keras

    import input.table_layers  # noqa: F401 (registers the engine's layers with Keras)
    import models  # noqa: F401

    loaded = keras.models.load_model(str(tmp_path / "export.keras"))
    answer = loaded({name: tf.reshape(value, (-1, 1)) for name, value in columns.items()})
    np.testing.assert_allclose(np.asarray(answer), probabilities, rtol=1e-4, atol=1e-5)
