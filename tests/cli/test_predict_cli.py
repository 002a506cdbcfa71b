"""`python -m engine.main --mode=predict`, as a user runs it after training: the outputs agree
with the run's own evaluation and with the exported SavedModel, for .npz and .csv inputs.

Covers: engine/cli/run/predictor.py, engine/cli/run/inputs_record.py,
engine/cli/config/settings/paths.py.
"""

import csv
import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO, copy_of, main_in_process, npz_bomb, one_error_line, python_env, snapshot

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
        ("inflates", "in.npz: x.npy inflates to 32.0 GiB (34359738368 bytes) from "),
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
    elif case == "inflates":  # A few hundred bytes whose x declares 32 GiB: numpy's MemoryError before.
        npz_bomb(inputs, member="x")
    before = snapshot(tmp_path), snapshot(trained[0])
    line = one_error_line(predict(model_dir, inputs, output))
    assert message in line, line
    assert (snapshot(tmp_path), snapshot(trained[0])) == before


def test_predict_reads_a_model_dir_it_may_not_write(trained, tmp_path, monkeypatch):
    """A shared or archived run (read-only to this user) predicts: it was refused as "not
    writable" though predict only reads it. As root no permission bites: `os.access` says
    what a read-only mount says, and the model_dir's files, times and entries stay as they were."""
    model_dir = copy_of(trained[0], tmp_path / "shared")
    np.savez(tmp_path / "in.npz", x=trained[2][:5])
    real_access = os.access

    def read_only(path, mode, *args, **kwargs):
        where = os.path.abspath(path)
        inside = where == str(model_dir) or where.startswith(f"{model_dir}/")
        return False if inside and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", read_only)
    before = {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in [model_dir, *model_dir.rglob("*")]}
    result = predict(model_dir, tmp_path / "in.npz", tmp_path / "out.npy")
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.load(tmp_path / "out.npy").shape == (5, 10)
    after = {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in [model_dir, *model_dir.rglob("*")]}
    assert after == before  # No lock file, no record, no touched time.


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_predict_on_a_read_only_mount_of_the_model_dir(trained, tmp_path):
    """The same on a real read-only file system: a bind mount in a mount namespace of its own
    (gone with the process, so nothing is left mounted). Needs the right to make one (root)."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m needs root)")
    model_dir = copy_of(trained[0], tmp_path / "archived")
    np.savez(tmp_path / "in.npz", x=trained[2][:5])
    flags = [*TRAIN, "--mode=predict", f"--model_dir={model_dir}", f"--predict_input={tmp_path / 'in.npz'}"]
    flags.append(f"--predict_output={tmp_path / 'out.npy'}")
    mount = f"mount --bind {model_dir} {model_dir} && mount -o remount,ro,bind {model_dir}"
    check = f"touch {model_dir}/probe 2>/dev/null && exit 99"  # The mount must be read-only.
    command = f'{mount} && {{ {check}; }}; exec "$@"'
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, "sh", sys.executable, "-m", "engine.main", *flags],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.load(tmp_path / "out.npy").shape == (5, 10)
    assert not (model_dir / "probe").exists()


def test_predict_flags_without_predict_mode_are_refused(trained, tmp_path):
    line = one_error_line(main_in_process(*TRAIN, f"--predict_input={tmp_path / 'x.npz'}"))
    assert "--predict_input/--predict_output need --mode=predict" in line


# ------------------------------------------------------------------ a CSV's columns, by name


@pytest.fixture(scope="module")
def csv_trained(tmp_path_factory):
    """A model_dir trained for two steps on a tiny CSV (a, b, c and the label), the rows' features,
    and no training CSV left: predict must not need it."""
    root = tmp_path_factory.mktemp("csv")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(64, 3)).astype(np.float32)
    write_table(root / "train.csv", ["a", "label", "b", "c"], features, (features[:, 0] > 0).astype(int))
    model_dir = root / "run"
    result = main_in_process(
        f"--dataset={root / 'train.csv'}",
        "--label_column=label",
        "--model=mlp",
        "--train_steps=2",
        "--mode=train",
        "--global_batch_size=16",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (root / "train.csv").unlink()
    return model_dir, features


def write_table(path, header, features, labels=None):
    """`features` under the columns a, b, c of `header` (any order, with others: label, id)."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row, x in enumerate(features):
            cells = {
                "a": x[0],
                "b": x[1],
                "c": x[2],
                "id": f"row{row}",
                "label": 0 if labels is None else labels[row],
            }
            writer.writerow([cells[name] for name in header])
    return path


def test_predict_reads_a_csv_by_column_name_without_the_training_csv(csv_trained, tmp_path):
    model_dir, features = csv_trained
    record = json.loads((model_dir / "inputs.json").read_text())
    assert (record["feature_columns"], record["label_column"]) == (["a", "b", "c"], "label")
    as_trained = write_table(tmp_path / "as_trained.csv", ["a", "label", "b", "c"], features)
    # Another order, no label column, a column of text the model does not take: the same predictions.
    shuffled = write_table(tmp_path / "shuffled.csv", ["id", "c", "a", "b"], features)
    before = snapshot(model_dir)
    first = predict(model_dir, as_trained, tmp_path / "first.npy")
    second = predict(model_dir, shuffled, tmp_path / "second.npy")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert "columns not read (not features): id" in second.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "first.npy"), np.load(tmp_path / "second.npy"))
    assert np.load(tmp_path / "first.npy").shape == (64, 1)  # A 0/1 label column: one binary logit.
    assert snapshot(model_dir) == before


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "has no column 'b'; the model was trained on the columns ['a', 'b', 'c'], found ['a', 'c']"),
        ("twice", "names column 'a' twice (columns 1 and 3)"),
        ("latin1", "'utf-8' codec can't decode byte 0xe9"),
        ("zero_d", "x is a single value (a 0-d array), not examples"),
    ],
)
def test_a_bad_csv_or_array_to_predict_is_one_line_and_writes_nothing(csv_trained, tmp_path, case, message):
    model_dir, features = csv_trained
    inputs = tmp_path / "in.csv"
    if case == "missing":
        write_table(inputs, ["a", "c"], features)
    elif case == "twice":
        inputs.write_text("a,b,a,c\n1,2,3,4\n")
    elif case == "latin1":
        inputs.write_bytes("a,b,c,caf\u00e9\n1,2,3,4\n".encode("latin-1"))
    else:
        inputs = tmp_path / "in.npz"
        np.savez(inputs, x=np.float32(3.0))
    before = snapshot(tmp_path), snapshot(model_dir)
    line = one_error_line(predict(model_dir, inputs, tmp_path / "out.npy"))
    assert message in line, line
    assert (snapshot(tmp_path), snapshot(model_dir)) == before


# ------------------------------------------------------------------ the output file


def test_an_output_that_appears_while_predicting_is_never_replaced(tmp_path, monkeypatch):
    from engine.cli.run import predictor
    from engine.errors import UserError

    outputs = np.arange(6, dtype=np.float32).reshape(3, 2)
    target = tmp_path / "out.npy"
    target.write_bytes(b"the other predict's rows")  # Written after this command checked the path.
    with pytest.raises(UserError, match="appeared while this command predicted .* it was left as it is"):
        predictor.write_rows(str(target), outputs)
    assert target.read_bytes() == b"the other predict's rows" and sorted(tmp_path.iterdir()) == [target]
    # Where the file system has no hard links, the name is claimed with O_EXCL: the same rule.
    monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    with pytest.raises(UserError, match="appeared while this command predicted"):
        predictor.write_rows(str(target), outputs)
    predictor.write_rows(str(tmp_path / "new.csv"), outputs)
    assert (tmp_path / "new.csv").read_text().splitlines() == [
        "output_0,output_1",
        "0.0,1.0",
        "2.0,3.0",
        "4.0,5.0",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.csv", "out.npy"]


def test_a_full_disk_under_the_output_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from engine.cli.run import predictor
    from engine.errors import UserError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(UserError) as raised:
        predictor.write_rows(str(tmp_path / "out.npy"), np.zeros((3, 2), np.float32))
    assert str(raised.value) == (
        f"--predict_output={tmp_path / 'out.npy'} cannot be written (No space left on device); free some space, "
        "or pass a --predict_output on another disk; nothing was written there"
    )
    assert list(tmp_path.iterdir()) == []  # The temporary file went too.


@pytest.mark.parametrize(
    "record",
    ['{"feature_shape": [3]', '{"feature_shape": [-1], "feature_dtype": "float32"}', "[]"],
    ids=["truncated", "negative", "list"],
)
def test_a_damaged_inputs_record_is_one_line(csv_trained, tmp_path, record):
    model_dir = copy_of(csv_trained[0], tmp_path / "run")
    (model_dir / "inputs.json").write_text(record)
    write_table(tmp_path / "in.csv", ["a", "b", "c"], csv_trained[1])
    line = one_error_line(predict(model_dir, tmp_path / "in.csv", tmp_path / "out.npy"))
    assert line == (
        f"engine.main: error: {model_dir}/inputs.json (what the training's examples were) is damaged; "
        "restore it or move it away (predict then reads the training's data again)"
    )
    assert not (tmp_path / "out.npy").exists()
