"""A user's own problem from the command line, as the README shows it: a CSV regression,
an .npz of colour images with 20 classes, 0/1 label columns, a user's data function and
task module; every bad input one line and exit 2 before anything is written.

Numbers are checked against references computed here: numpy on the exported model's
outputs for the eval loss, the predict-the-mean baseline, the data's own shapes.

Covers: engine/cli/run/run_task.py, engine/task.py.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import main_in_process, one_error_line, snapshot


def write_csv(path: Path, header: list[str], rows) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def diabetes_files(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's diabetes set (offline): 400 train rows and 42 eval rows, as files."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    header = [*data.feature_names, "progression"]
    rows = [[*map(float, x), float(y)] for x, y in zip(data.data, data.target, strict=True)]
    train = write_csv(tmp_path / "diabetes.csv", header, rows[:400])
    evaluation = write_csv(tmp_path / "diabetes_eval.csv", header, rows[400:])
    return train, evaluation, data.data[400:].astype(np.float32), data.target[400:], data.target[:400]


def metrics_of(model_dir: Path) -> dict:
    return json.loads((model_dir / "metrics.json").read_text())


@pytest.mark.slow
def test_a_csv_regression_beats_the_mean_and_reports_the_mse_of_its_own_export(tmp_path):
    train, evaluation, x_eval, y_eval, y_train = diabetes_files(tmp_path)
    model_dir, export_dir = tmp_path / "run", tmp_path / "export"
    result = main_in_process(
        f"--dataset={train}",
        "--label_column=progression",
        f"--eval_file={evaluation}",
        "--model=mlp",
        "--train_steps=500",
        "--eval_every=0",
        "--learning_rate=0.02",
        "--global_batch_size=40",
        "--metrics=mae,r2",
        f"--model_dir={model_dir}",
        f"--export_dir={export_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = metrics_of(model_dir)["eval"]
    assert evaluated["num_examples"] == len(y_eval)
    baseline = float(np.mean((y_eval - y_train.mean()) ** 2))  # Predict the train mean.
    assert evaluated["loss"] < 0.8 * baseline, (evaluated, baseline)
    # The reference: the exported model's outputs on the eval rows, scored with numpy.
    served = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    outputs = served(features=tf.constant(x_eval))["predictions"].numpy()
    assert outputs.shape == (len(y_eval), 1)
    mse = float(np.mean((outputs[:, 0] - y_eval) ** 2))
    mae = float(np.mean(np.abs(outputs[:, 0] - y_eval)))
    r2 = 1.0 - float(np.sum((outputs[:, 0] - y_eval) ** 2) / np.sum((y_eval - y_eval.mean()) ** 2))
    np.testing.assert_allclose([evaluated["loss"], evaluated["mae"], evaluated["r2"]], [mse, mae, r2], rtol=1e-4)
    assert "labels=one value" in result.stderr and "loss=mse" in result.stderr
    assert "columns: 10 numbers (age, sex, bmi, bp, s1, s2, s3, s4, s5, s6)" in result.stderr
    # Predict on the eval table as it is (its label column is dropped): the export's predictions.
    predicted = main_in_process(
        "--mode=predict",
        f"--dataset={train}",
        "--label_column=progression",
        f"--eval_file={evaluation}",
        "--model=mlp",
        f"--model_dir={model_dir}",
        f"--predict_input={evaluation}",
        f"--predict_output={tmp_path / 'progression.csv'}",
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = list(csv.reader(open(tmp_path / "progression.csv", newline="")))
    assert len(rows) == len(y_eval) + 1
    np.testing.assert_allclose(np.asarray(rows[1:], dtype=np.float32), outputs, rtol=1e-5, atol=1e-4)


def _table(tmp_path: Path, name: str, label: str) -> Path:
    """One of scikit-learn's bundled tables (offline) as a CSV: decimal features, its labels as
    written (class ids as integers, a regression's values as decimals)."""
    from sklearn import datasets

    data = getattr(datasets, f"load_{name}")()
    header = [column.replace(" ", "_") for column in data.feature_names] + [label]
    integers = np.issubdtype(data.target.dtype, np.integer)
    rows = [
        [*map(float, x), int(y) if integers else float(y)] for x, y in zip(data.data, data.target, strict=True)
    ]
    return write_csv(tmp_path / f"{name}.csv", header, rows)


def _tuned_keras_mae(table: Path, label: str) -> float:
    """The best eval MAE of Keras `fit` over a small grid of lengths, on the engine's own eval split:
    the features normalized by an adapted `Normalization`, the labels standardized by hand.
    One fit of the longest length, evaluated at the end of each length's last epoch: the weights
    there are those of a fit of that length (the same seed, the same batches; checked equal to
    the digit), at a third less of the test's CPU than a fit for each length."""
    import keras

    from input.arrays import split_off_eval
    from input.files import read_table

    _, features, labels = read_table(str(table), label)
    (x_train, y_train), (x_eval, y_eval) = split_off_eval(features, labels, 0.1, "table")
    mean, std = y_train.mean(), y_train.std()
    lengths = (80, 160)  # 560 and 1,120 steps of 64 (longer overfits: MAE 53 at 4,000).
    keras.utils.set_random_seed(0)
    normalization = keras.layers.Normalization()
    normalization.adapt(x_train)
    inputs = keras.Input(features.shape[1:])
    hidden = keras.layers.Dense(128, activation="relu")(normalization(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    maes = []

    def evaluate_at_a_length(epoch: int, logs: dict) -> None:
        if epoch + 1 in lengths:
            predictions = model.predict(x_eval, verbose=0)[:, 0] * std + mean
            maes.append(float(np.mean(np.abs(predictions - y_eval))))

    at_each_length = [keras.callbacks.LambdaCallback(on_epoch_end=evaluate_at_a_length)]
    standardized = (y_train - mean) / std
    model.fit(x_train, standardized, batch_size=64, epochs=max(lengths), verbose=0, callbacks=at_each_length)
    assert len(maes) == len(lengths)
    return min(maes)


@pytest.mark.slow
def test_tables_train_well_with_the_readmes_own_command_and_no_tuning(tmp_path):
    """Before --normalize and the 500-step floor: diabetes MAE 151.6, wine accuracy 0.17-0.69."""
    tables = {"diabetes": "progression", "wine": "cultivar", "breast_cancer": "malignant"}
    results = {}
    for name, label in tables.items():
        table = _table(tmp_path, name, label)
        extra = ["--metrics=accuracy,auc"] if name == "breast_cancer" else []
        run = main_in_process(
            f"--dataset={table}",
            f"--label_column={label}",
            "--model=mlp",
            *extra,
            f"--model_dir={tmp_path / name}",
        )
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = metrics_of(tmp_path / name)
        assert results[name]["global_step"] == 500  # 20 epochs of these are 60-160 steps.
    reference = _tuned_keras_mae(tmp_path / "diabetes.csv", "progression")
    assert results["diabetes"]["eval"]["mae"] <= 1.1 * reference, (results["diabetes"]["eval"], reference)
    assert results["wine"]["eval"]["accuracy"] >= 0.95, results["wine"]["eval"]
    assert results["breast_cancer"]["eval"]["auc"] >= 0.97, results["breast_cancer"]["eval"]


USER_NETS = """
import keras

seen = []


def colour_net(input_shape, num_outputs):
    seen.append((tuple(input_shape), num_outputs))
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))
"""


def test_an_npz_of_colour_images_with_20_classes_trains_the_users_model_at_that_shape(tmp_path, monkeypatch):
    rng = np.random.RandomState(0)
    images = rng.randint(0, 256, size=(120, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(120) % 20
    np.savez(
        tmp_path / "colour.npz",
        x_train=images[:100],
        y_train=labels[:100],
        x_test=images[100:],
        y_test=labels[100:],
    )
    (tmp_path / "colour_nets.py").write_text(USER_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "run"
    result = main_in_process(
        f"--dataset={tmp_path / 'colour.npz'}",
        "--model=colour_nets:colour_net",
        "--train_steps=3",
        "--eval_every=0",
        "--global_batch_size=20",
        f"--model_dir={model_dir}",
        f"--export_dir={tmp_path / 'export'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import colour_nets

    assert colour_nets.seen == [((32, 32, 3), 20)]
    evaluated = metrics_of(model_dir)["eval"]
    assert evaluated["num_examples"] == 20 and 0.0 <= evaluated["accuracy"] <= 1.0
    assert "labels=20 classes" in result.stderr
    # The export takes the raw uint8 pixels (its own 1/255) and predicts what --mode=predict does.
    np.savez(tmp_path / "new.npz", x=images[100:])
    predicted = main_in_process(
        "--mode=predict",
        f"--dataset={tmp_path / 'colour.npz'}",
        "--model=colour_nets:colour_net",
        f"--model_dir={model_dir}",
        f"--predict_input={tmp_path / 'new.npz'}",
        f"--predict_output={tmp_path / 'out.npy'}",
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    assert served.structured_input_signature[1]["features"].dtype == tf.uint8
    outputs = served(features=tf.constant(images[100:]))
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), outputs["logits"].numpy(), rtol=1e-5, atol=1e-6)
    assert np.mean(outputs["logits"].numpy().argmax(axis=1) == labels[100:]) == pytest.approx(
        evaluated["accuracy"]
    )


def multi_label_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] < -0.5], axis=1).astype(np.int64)
    np.savez(path, x_train=x[:160], y_train=y[:160], x_test=x[160:], y_test=y[160:])
    return x[160:], y[160:]


@pytest.mark.slow
def test_multi_label_columns_train_with_binary_crossentropy_and_keep_the_best_auc(tmp_path):
    x_eval, y_eval = multi_label_npz(tmp_path / "tags.npz")
    model_dir = tmp_path / "run"
    result = main_in_process(
        f"--dataset={tmp_path / 'tags.npz'}",
        "--model=mlp",
        "--metrics=accuracy,auc",
        "--best_checkpoint_metric=auc",
        "--train_steps=60",
        "--eval_every=20",
        "--global_batch_size=32",
        "--learning_rate=0.01",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss=binary_crossentropy" in result.stderr and "labels=3 binary labels" in result.stderr
    evaluated = metrics_of(model_dir)["eval"]
    assert evaluated["auc"] > 0.8 and evaluated["accuracy"] > 0.7, evaluated
    assert (model_dir / "best").is_dir()
    # Predict: one row of 3 logits per example, in order; their sigmoid scores as the eval did.
    np.savez(tmp_path / "new.npz", x=x_eval)
    out = tmp_path / "tags.npy"
    predicted = main_in_process(
        "--mode=predict",
        f"--dataset={tmp_path / 'tags.npz'}",
        "--model=mlp",
        f"--model_dir={model_dir}",
        f"--predict_input={tmp_path / 'new.npz'}",
        f"--predict_output={out}",
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    logits = np.load(out)
    assert logits.shape == (len(x_eval), 3)
    accuracy = float(np.mean((logits > 0) == (y_eval == 1)))
    np.testing.assert_allclose(accuracy, evaluated["accuracy"], atol=1e-6)


def test_integer_labels_read_as_values_by_a_regression_loss(tmp_path):
    x = np.linspace(-1, 1, 64, dtype=np.float32)[:, None]
    y = np.round(3 * x[:, 0] + 5).astype(np.int64)  # Integers: class ids unless the loss says values.
    np.savez(tmp_path / "line.npz", x_train=x, y_train=y)
    result = main_in_process(
        f"--dataset={tmp_path / 'line.npz'}",
        "--model=mlp",
        "--loss=huber",
        "--train_steps=2",
        "--eval_every=0",
        "--global_batch_size=16",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss=huber  metrics=mae  labels=one value" in result.stderr
    # The default --eval_fraction held out a tenth, always the same rows.
    assert metrics_of(tmp_path / "run")["eval"]["num_examples"] == 6


def test_binary_crossentropy_on_0_1_class_ids_has_one_output(tmp_path):
    x = np.random.RandomState(2).normal(size=(50, 4)).astype(np.float32)
    np.savez(tmp_path / "yes_no.npz", x_train=x, y_train=(x[:, 0] > 0).astype(np.int32))
    result = main_in_process(
        f"--dataset={tmp_path / 'yes_no.npz'}",
        "--model=mlp",
        "--loss=binary_crossentropy",
        "--train_steps=2",
        "--eval_every=0",
        "--global_batch_size=15",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "labels=1 binary labels" in result.stderr
    assert "(None, 1)" in result.stderr  # The model summary's output layer.


DATA_FUNCTIONS = """
import numpy as np
import tensorflow as tf


def pairs():
    rng = np.random.RandomState(3)
    x = rng.normal(size=(90, 5)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int64) + 2 * (x[:, 0] > 1)
    train = tf.data.Dataset.from_tensor_slices((x[:70], y[:70]))
    return train, tf.data.Dataset.from_tensor_slices((x[70:], y[70:]))


def batched():
    return tf.data.Dataset.from_tensor_slices((np.zeros((8, 2), np.float32), np.zeros(8))).batch(4), None


def endless():
    return tf.data.Dataset.from_tensor_slices((np.zeros((8, 2), np.float32), np.zeros(8))).repeat(), None


def not_data():
    return [1, 2, 3]
"""


def test_a_data_function_of_tf_data_datasets_trains_with_their_shapes_and_classes(tmp_path, monkeypatch):
    (tmp_path / "my_data.py").write_text(DATA_FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = main_in_process(
        "--dataset=my_data:pairs",
        "--model=mlp",
        "--train_steps=2",
        "--eval_every=0",
        "--global_batch_size=10",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "labels=4 classes" in result.stderr and "examples (5,)" in result.stderr
    assert metrics_of(tmp_path / "run")["eval"]["num_examples"] == 20


def _refused(tmp_path: Path, *flags: str, cwd: Path | None = None) -> str:
    """Runs the command on a model_dir holding an earlier run's file; returns its one error line
    after checking that it exited 2 and left the directory as it was."""
    model_dir = tmp_path / "run"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    result = main_in_process(*flags, "--train_steps=2", f"--model_dir={model_dir}", cwd=cwd)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert snapshot(model_dir) == before
    return one_error_line(result)


def test_bad_data_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    table = write_csv(tmp_path / "t.csv", ["a", "b", "y"], [[1, 2, 0], [3, 4, 1], [5, 6, 1]])
    # A table with text or blanks trains (input.tables); what still cannot train is refused.
    blank = write_csv(tmp_path / "blank.csv", ["a", "b", "y"], [[index, "", index % 2] for index in range(10)])
    one_class = write_csv(tmp_path / "one.csv", ["a", "y"], [[index, "cat"] for index in range(10)])
    dates = write_csv(
        tmp_path / "dates.csv", ["when", "y"], [[f"2024-0{index % 9 + 1}-30", index % 2] for index in range(10)]
    )
    names = write_csv(tmp_path / "names.csv", ["name", "a", "y"], [[f"n{i}", i, i % 2] for i in range(10)])
    twice = write_csv(tmp_path / "twice.csv", ["a", "y", "y"], [[1, 2, 0], [3, 4, 1], [5, 6, 1]])
    stray = tmp_path / "stray.csv"  # A comma too many shifts every cell after it (numpy's reader: refused too).
    stray.write_text("a,b,y\n1,2,0\n3,4,5,1\n5,6,1\n")
    shifted = tmp_path / "shifted.csv"  # Every row one cell longer than the header.
    shifted.write_text("a,b,y\n1,2,0,9\n3,4,1,9\n")
    np.savez(tmp_path / "no_x.npz", features=np.zeros((4, 2)), y_train=np.zeros(4))
    np.savez(tmp_path / "five.npz", x_train=np.zeros((10, 2), np.float32), y_train=np.arange(10) % 5)
    (tmp_path / "my_data.py").write_text(DATA_FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        ([f"--dataset={table}", "--label_column=label"], f"--dataset={table} has no column 'label'"),
        ([f"--dataset={table}"], "needs --label_column=NAME"),
        ([f"--dataset={blank}", "--label_column=y"], "column 'b' is blank in every training row"),
        ([f"--dataset={one_class}", "--label_column=y"], "the label 'y' holds one class ('cat') only"),
        ([f"--dataset={dates}", "--label_column=y"], "column 'when' holds '2024-02-30', which is not a date"),
        (
            [f"--dataset={names}", "--label_column=y", "--column_types=name:category"],
            "column 'name' is set to category but its 9 training rows hold 9 values",
        ),
        ([f"--dataset={stray}", "--label_column=y"], "line 3 has 4 values under 3 columns"),
        ([f"--dataset={shifted}", "--label_column=y"], "line 2 has 4 values under 3 columns"),
        # It trained on one of the two copies (whichever `index` found): now refused.
        ([f"--dataset={twice}", "--label_column=y"], "names column 'y' twice (columns 2 and 3)"),
        ([f"--dataset={tmp_path / 'no_x.npz'}"], "but no x_train; an .npz data set needs x_train and y_train"),
        (
            [
                f"--dataset={tmp_path / 'five.npz'}",
                "--model=mlp",
                "--loss=binary_crossentropy",
                "--global_batch_size=3",
            ],
            "a binary loss takes labels of 0 and 1, but they hold [2, 3, 4]",
        ),
        (
            [f"--dataset={tmp_path / 'five.npz'}", "--model=cnn", "--global_batch_size=3"],
            "--model=cnn cannot take the data's examples of shape (None, 2)",
        ),
        (["--dataset=my_data:batched"], "look batched; return unbatched examples"),
        (["--dataset=my_data:endless"], "is infinite (a repeat()?)"),
        (["--dataset=my_data:not_data"], "gave list; give (train, eval) tf.data.Datasets"),
        (["--dataset=my_data:missing"], "has no function 'missing'"),
        (["--label_column=y"], "--label_column=y is for --dataset=PATH.csv"),
        (
            ["--loss=cross_entropy"],
            "unknown --loss='cross_entropy'; choose one of: sparse_categorical_crossentropy",
        ),
        (["--loss=mse"], "--loss=mse reads values labels but the data's labels are 10 classes"),
        (["--metrics=accuracy,mae"], "metric 'mae' has no meaning for classes labels"),
        (["--metrics=no_such_metric"], "unknown metric 'no_such_metric'"),
        (
            ["--best_checkpoint_metric=auc"],
            "--best_checkpoint_metric=auc is not an eval metric of this run; it reports: loss, accuracy",
        ),
        (["--early_stop_metric=acc"], "--early_stop_metric=acc is not an eval metric of this run"),
    ]
    for flags, message in cases:
        line = _refused(tmp_path, *flags)
        assert message in line, (flags, line)


def test_npz_arrays_of_the_wrong_shape_or_kind_are_one_line_before_anything_is_written(tmp_path):
    x, y = np.zeros((10, 3), np.float32), np.arange(10) % 2
    cases = {
        "lengths": ({"x_train": x, "y_train": y[:9]}, "x_train holds 10 examples but y_train 9 labels"),
        "scalar x": ({"x_train": np.float32(3.0), "y_train": y}, "x_train has shape (); it must be (N, ...)"),
        "scalar y": ({"x_train": x, "y_train": np.int64(1)}, "y_train has shape (); labels must be (N,)"),
        # (N, 0) aborted the process inside oneDNN, after the model_dir was written.
        "empty x": ({"x_train": np.zeros((10, 0), np.float32), "y_train": y}, "x_train has shape (10, 0)"),
        "empty test": (
            {"x_train": x, "y_train": y, "x_test": np.zeros((4, 0), np.float32), "y_test": y[:4]},
            "x_test has shape (4, 0): its examples hold no values",
        ),
        # Complex features trained as zeros (their real part), in silence.
        "complex": ({"x_train": x + 1j, "y_train": y}, "x_train holds complex numbers (complex64)"),
        "strings": ({"x_train": np.array([["a", "b"]] * 10), "y_train": y}, "x_train holds strings (<U1)"),
        "objects": ({"x_train": np.array([[1, "a"]] * 10, dtype=object), "y_train": y}, "x_train holds Python"),
    }
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.npz"
        np.savez(path, **arrays)
        line = _refused(tmp_path, f"--dataset={path}", "--model=mlp", "--global_batch_size=2")
        assert f"--dataset={path}: {message}" in line, (name, line)


USER_FUNCTIONS_THAT_EXIT = """
import sys


def data():
    sys.exit(0)


def task():
    sys.exit(0)


def model(input_shape, num_outputs):
    sys.exit()
"""


@pytest.mark.parametrize(
    "flag, said",
    [
        ("--dataset=exits:data", "--dataset=exits:data"),
        ("--task=exits:task", "--task=exits:task"),
        ("--model=exits:model", "--model=exits:model"),
    ],
)
def test_a_user_function_that_calls_sys_exit_is_one_line_not_a_silent_success(tmp_path, flag, said):
    (tmp_path / "exits.py").write_text(USER_FUNCTIONS_THAT_EXIT)
    line = _refused(tmp_path, flag, cwd=tmp_path)
    assert line.startswith(f"engine.main: error: {said}") and "called sys.exit(" in line, line
    assert "instead of returning" in line, line


TASKS = """
import keras
import numpy as np
import tensorflow as tf

import engine


def build(input_shape, num_outputs):
    inputs = keras.Input(input_shape)
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(hidden))


def data():
    rng = np.random.RandomState(4)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = np.stack([x[:, 0] * 2 - x[:, 1], np.sin(x[:, 2])], axis=1).astype(np.float32)
    train = tf.data.Dataset.from_tensor_slices((x[:200], y[:200]))
    return train, tf.data.Dataset.from_tensor_slices((x[200:], y[200:]))


def regression(width=16):
    return engine.Task(model=build, data=data, loss="mse", metrics=["mae", "rmse"])


def wrong():
    return {"model": build}
"""


def test_a_task_module_gives_the_whole_problem(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = main_in_process(
        "--task=my_tasks:regression",
        "--train_steps=20",
        "--eval_every=0",
        "--global_batch_size=20",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = metrics_of(tmp_path / "run")["eval"]
    assert sorted(evaluated) == ["loss", "mae", "num_examples", "rmse"] and evaluated["num_examples"] == 56
    assert "labels=2 value(s)" in result.stderr
    # The trained model_dir refuses another task; a new one refuses a function that gives no Task.
    assert "--task=my_tasks:wrong differs from task=my_tasks:regression" in _refused(
        tmp_path, "--task=my_tasks:wrong"
    )
    (tmp_path / "new").mkdir()
    assert "returned dict, not an engine.Task" in _refused(tmp_path / "new", "--task=my_tasks:wrong")


@pytest.mark.slow
def test_a_task_module_trains_mirrored_and_resumes_bitwise(tmp_path, monkeypatch):
    (tmp_path / "mirrored_tasks.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["--task=mirrored_tasks:regression", "--strategy=mirrored", "--cpu_devices=2",
              "--global_batch_size=20", "--eval_every=0", "--checkpoint_every=6"]  # fmt: skip
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    done = main_in_process(*common, "--train_steps=12", f"--model_dir={whole}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "strategy=mirrored  replicas=2" in done.stderr
    first = main_in_process(*common, "--train_steps=6", f"--model_dir={parts}")
    second = main_in_process(*common, "--train_steps=12", f"--model_dir={parts}")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert "steps=6->12" in second.stderr  # Resumed, not restarted.
    reader_a = tf.train.load_checkpoint(str(whole / "checkpoints" / "ckpt-12"))
    reader_b = tf.train.load_checkpoint(str(parts / "checkpoints" / "ckpt-12"))
    names = [name for name in reader_a.get_variable_to_shape_map() if name != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    assert any("_trainable_variables" in name for name in names), names  # The weights and the optimizer's state.
    for name in names:
        np.testing.assert_array_equal(reader_a.get_tensor(name), reader_b.get_tensor(name), err_msg=name)
    assert metrics_of(whole)["eval"] == metrics_of(parts)["eval"]


def test_the_task_example_of_the_docs_runs_as_printed(tmp_path, monkeypatch):
    from helpers import REPO

    page = (REPO / "docs" / "your-problem.md").read_text()
    (example,) = re.findall(r"<!-- example: task -->\s*```python\n(.*?)```", page, re.S)
    (tmp_path / "docs_tasks.py").write_text(example)  # Not my_tasks: another test imported one.
    monkeypatch.syspath_prepend(str(tmp_path))
    result = main_in_process(
        "--task=docs_tasks:two_targets",
        "--best_checkpoint_metric=r2",
        "--train_steps=30",
        "--eval_every=0",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = metrics_of(tmp_path / "run")["eval"]
    assert evaluated["num_examples"] == 200 and sorted(evaluated) == ["loss", "mae", "num_examples", "r2"]
    assert "loss=huber  metrics=mae,r2  labels=2 value(s)" in result.stderr


@pytest.mark.slow  # Three runs over TFRecord files: seconds.
def test_image_tfrecords_keep_their_size_and_channels_unless_asked(tmp_path, monkeypatch):
    from input import write_tfrecords

    rng = np.random.RandomState(5)
    images = rng.randint(0, 256, size=(40, 12, 12, 3), dtype=np.uint8)
    labels = np.arange(40) % 13
    write_tfrecords(str(tmp_path / "data" / "train-0"), images[:30], labels[:30])
    write_tfrecords(str(tmp_path / "data" / "eval-0"), images[30:], labels[25:35])  # Holds label 12.
    (tmp_path / "colour_nets.py").write_text(USER_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import colour_nets

    for extra, shape in (([], (12, 12, 3)), (["--image_shape=8,8,1"], (8, 8, 1))):
        colour_nets.seen.clear()
        result = main_in_process(
            "--dataset=tfrecord",
            f"--data_dir={tmp_path / 'data'}",
            "--model=colour_nets:colour_net",
            "--train_steps=2",
            "--eval_every=0",
            "--global_batch_size=10",
            f"--model_dir={tmp_path / ('run' + str(len(extra)))}",
            *extra,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert colour_nets.seen == [(shape, 13)]
        assert metrics_of(tmp_path / ("run" + str(len(extra))))["eval"]["num_examples"] == 10
    assert "--image_shape=8,8 must be H,W,C" in _refused(tmp_path, "--image_shape=8,8")
    # Eval files without the largest class: the run stops at the first larger label, asking for it.
    write_tfrecords(str(tmp_path / "fewer" / "train-0"), images[:30], labels[:30])
    write_tfrecords(str(tmp_path / "fewer" / "eval-0"), images[30:], labels[27:37])  # Labels 1..10.
    result = main_in_process(
        "--dataset=tfrecord",
        f"--data_dir={tmp_path / 'fewer'}",
        "--model=mlp",
        "--train_steps=10",
        "--global_batch_size=10",
        f"--model_dir={tmp_path / 'fewer_run'}",
    )
    assert result.returncode == 2
    assert "tfrecord label >= num_classes=11 (pass --num_classes)" in one_error_line(result)
