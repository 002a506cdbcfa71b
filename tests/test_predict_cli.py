"""`python -m engine.main --mode=predict`, as a user runs it after training: the outputs agree
with the run's own evaluation and with the exported SavedModel, for .npz and .csv inputs."""

import csv
import json

import numpy as np
import pytest
import tensorflow as tf
from helpers import main_in_process, one_error_line, snapshot

TRAIN = ["--model=mlp", "--train_steps=20", "--steps_per_loop=10", "--global_batch_size=32", "--eval_every=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir trained on the digits, its export, and the digits' eval split (28x28x1 floats)."""
    root = tmp_path_factory.mktemp("predict")
    model_dir, export_dir = root / "run", root / "export"
    result = main_in_process(*TRAIN, f"--model_dir={model_dir}", f"--export_dir={export_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    from input.registry import get_data_source

    source = get_data_source("digits", image_shape=(28, 28, 1))
    images, labels = [], []
    for x, y in source.eval_dataset(global_batch_size=64):
        images.append(x.numpy())
        labels.append(y.numpy())
    return model_dir, export_dir, np.concatenate(images), np.concatenate(labels)


def predict(model_dir, predict_input, predict_output, *extra):
    return main_in_process(
        *TRAIN,
        "--mode=predict",
        f"--model_dir={model_dir}",
        f"--predict_input={predict_input}",
        f"--predict_output={predict_output}",
        *extra,
    )


def test_predictions_agree_with_the_evaluation_and_the_export(trained, tmp_path):
    model_dir, export_dir, images, labels = trained
    np.savez(tmp_path / "eval.npz", x=images)
    before = snapshot(model_dir)
    result = predict(
        model_dir, tmp_path / "eval.npz", tmp_path / "out.npy", "--cpu_devices=2", "--strategy=mirrored"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert snapshot(model_dir) == before  # The model_dir is only read.
    outputs = np.load(tmp_path / "out.npy")
    assert outputs.shape == (len(images), 10)
    # The run's own evaluation counted these examples right as often as the predictions say.
    accuracy = json.loads((model_dir / "metrics.json").read_text())["eval"]["accuracy"]
    assert np.mean(outputs.argmax(axis=1) == labels) == pytest.approx(accuracy, abs=1e-6)
    # The SavedModel on the same inputs, row for row.
    exported = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    served = exported(features=tf.constant(images))["logits"].numpy()
    np.testing.assert_allclose(outputs, served, rtol=1e-5, atol=1e-5)


def test_uint8_pixels_and_csv_rows_are_prepared_as_in_training(trained, tmp_path):
    model_dir, _, images, _ = trained
    pixels = np.round(images[:40] * 255).astype(np.uint8)
    np.savez(tmp_path / "pixels.npz", x=pixels[..., 0])  # (N, 28, 28): reshaped to the model's input
    with open(tmp_path / "pixels.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f"p{i}" for i in range(784)])
        writer.writerows((pixels.reshape(40, -1) / 255.0).tolist())
    assert predict(model_dir, tmp_path / "pixels.npz", tmp_path / "a.npy").returncode == 0
    assert predict(model_dir, tmp_path / "pixels.csv", tmp_path / "b.csv").returncode == 0
    from_npz = np.load(tmp_path / "a.npy")
    with open(tmp_path / "b.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == [f"output_{i}" for i in range(10)] and len(rows) == 41
    np.testing.assert_allclose(np.asarray(rows[1:], dtype=np.float32), from_npz, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_x", "holds ['images'], no `x` array of examples"),
        ("shape", "examples of shape (5,) do not fit the model's input (28, 28, 1)"),
        ("text", "line 2, column 'b' 'two' is not a number"),
        ("exists", "exists; remove it or pass a new path"),
        ("untrained", "no checkpoint in"),
        ("suffix", "must end in .npy or .csv"),
    ],
)
def test_bad_predict_input_is_one_line_and_writes_nothing(trained, tmp_path, case, message):
    model_dir = trained[0]
    inputs, output = tmp_path / "in.npz", tmp_path / "out.npy"
    np.savez(inputs, x=np.zeros((3, 28, 28, 1), np.float32))
    if case == "no_x":
        np.savez(inputs, images=np.zeros((3, 28, 28, 1), np.float32))
    elif case == "shape":
        np.savez(inputs, x=np.zeros((3, 5), np.float32))
    elif case == "text":
        inputs = tmp_path / "in.csv"
        inputs.write_text("a,b\n1,two\n")
    elif case == "exists":
        output.write_bytes(b"the user's own file")
    elif case == "untrained":
        model_dir = tmp_path / "empty"
        model_dir.mkdir()
    elif case == "suffix":
        output = tmp_path / "out.txt"
    before = snapshot(tmp_path), snapshot(trained[0])
    line = one_error_line(predict(model_dir, inputs, output))
    assert message in line, line
    assert (snapshot(tmp_path), snapshot(trained[0])) == before


def test_predict_flags_without_predict_mode_are_refused(trained, tmp_path):
    line = one_error_line(main_in_process(*TRAIN, f"--predict_input={tmp_path / 'x.npz'}"))
    assert "--predict_input/--predict_output need --mode=predict" in line
