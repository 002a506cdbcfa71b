"""Nothing lost, part 2: one writer per model_dir, no checkpoint overwritten,
every bad input one line with exit 2 and the model_dir left byte-identical.

Real `python -m engine.main` processes wherever processes matter (the lock,
kill -9, signals, a full disk); small mlp runs to stay fast.
The library's side, in this process: tests/unit/test_model_dir.py (the lock, the records)
and tests/unit/checkpointing/ (test_discovery.py, test_checkpointer.py).

Covers: engine/checkpointing/repairs.py.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    REPO,
    checkpoint_files,
    copy_of,
    file_tree,
    main_in_process,
    make_trainer,
    one_error_line,
    popen_main,
    python_env,
    read_stderr_until,
    run_main,
    snapshot,
    stop,
    wait_for_checkpoint,
)

from engine import model_dir as model_dir_lib
from engine.checkpointing import discovery
from engine.errors import UserError

MLP = ["--model=mlp", "--checkpoint_every=10", "--eval_every=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """An mlp model_dir with checkpoints at steps 10 and 20, an early-stopping
    history and a best checkpoint by accuracy (20 steps, trained in-process)."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    result = main_in_process(
        "--model=mlp",
        "--train_steps=20",
        "--checkpoint_every=10",
        "--eval_every=10",
        "--early_stop_metric=loss",
        "--early_stop_patience=5",
        "--best_checkpoint_metric=accuracy",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir


TRAINED_FLAGS = [
    "--model=mlp",
    "--checkpoint_every=10",
    "--eval_every=10",
    "--early_stop_metric=loss",
    "--early_stop_patience=5",
    "--best_checkpoint_metric=accuracy",
]


# ----------------------------------------------------------------- the lock


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_in_start_up_exits_143_and_leaves_no_lock_file(tmp_path):
    model_dir = tmp_path / "run"
    process = popen_main(*MLP, "--train_steps=1000000", f"--model_dir={model_dir}")
    try:
        deadline = time.monotonic() + 240
        while not (model_dir / model_dir_lib.LOCK_FILE).exists():  # Locked: building, not training yet.
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM received: exiting now with status 143" in stderr, stderr[-3000:]
    assert not (model_dir / model_dir_lib.LOCK_FILE).exists()


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_second_run_on_a_model_dir_exits_2_naming_the_holder(tmp_path):
    model_dir = tmp_path / "run"
    first = popen_main(
        "--model=mlp",
        "--train_steps=1000000",
        "--steps_per_loop=20",
        "--eval_every=0",
        "--checkpoint_every=200",
        f"--model_dir={model_dir}",
    )
    try:
        wait_for_checkpoint(model_dir, first)
        assert model_dir_lib.holder_pid(str(model_dir)) == first.pid
        # The second run in this process (another pid than the holder's): refused before it trains.
        second = main_in_process("--model=mlp", "--train_steps=50", "--eval_every=0", f"--model_dir={model_dir}")
        line = one_error_line(second)
        assert f"is in use by pid {first.pid} on host" in line, line
        assert first.poll() is None  # the holder is untouched and still training
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
        assert first.returncode == 128 + signal.SIGTERM
    finally:
        stop(first)
    assert not (model_dir / model_dir_lib.LOCK_FILE).exists()  # released on a clean stop


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lock_left_by_kill_9_is_taken_over_with_a_warning(tmp_path):
    model_dir = tmp_path / "run"
    killed = popen_main(*MLP, "--train_steps=1000000", "--steps_per_loop=5", f"--model_dir={model_dir}")
    try:
        wait_for_checkpoint(model_dir, killed)
    finally:
        stop(killed)  # SIGKILL: the lock file stays, naming a dead process
    assert model_dir_lib.holder_pid(str(model_dir)) == killed.pid
    rerun = main_in_process(*MLP, "--train_steps=5", f"--model_dir={model_dir}")  # 5 steps, in this process
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"took over the writer lock of pid {killed.pid}" in rerun.stderr
    assert not (model_dir / model_dir_lib.LOCK_FILE).exists()


# --------------------------------------------------- checkpoint discovery


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "garbage", "empty"])
def test_lost_state_file_recovers_the_newest_checkpoint_and_overwrites_nothing(trained, tmp_path, damage):
    model_dir = copy_of(trained, tmp_path / "run")
    state = model_dir / "checkpoints" / "checkpoint"
    if damage == "deleted":
        state.unlink()
    else:
        state.write_text("model_checkpoint_path: {{{ garbage" if damage == "garbage" else "")
    before = checkpoint_files(model_dir)
    result = main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps=20->30" in result.stderr
    assert "was missing" in result.stderr or "was damaged" in result.stderr
    after = checkpoint_files(model_dir)
    assert {name: after[name] for name in before} == before  # ckpt-10, ckpt-20: same bytes, same mtime
    assert "ckpt-30.index" in after
    if damage != "deleted":
        assert (model_dir / "checkpoints" / "checkpoint.damaged").exists()


@pytest.mark.cli
@pytest.mark.slow
def test_lost_state_file_with_no_readable_checkpoint_is_refused(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    (model_dir / "checkpoints" / "checkpoint").unlink()
    for index in (model_dir / "checkpoints").glob("ckpt-*.index"):
        index.write_bytes(b"\0" * index.stat().st_size)
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}"))
    assert "none of them can be read" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["zeroed index", "deleted data", "flipped data"])
def test_unreadable_checkpoint_of_any_kind_is_one_line_and_fallback_recovers(trained, tmp_path, damage):
    model_dir = copy_of(trained, tmp_path / "run")
    checkpoints = model_dir / "checkpoints"
    index, data = checkpoints / "ckpt-20.index", next(checkpoints.glob("ckpt-20.data-*"))
    if damage == "zeroed index":
        index.write_bytes(b"\0" * index.stat().st_size)
    elif damage == "deleted data":
        data.unlink()
    else:
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}"))
    assert "ckpt-20 cannot be read" in line and "--restore_fallback" in line
    assert snapshot(model_dir) == before
    recovered = main_in_process(
        *TRAINED_FLAGS, "--train_steps=30", "--restore_fallback", f"--model_dir={model_dir}"
    )
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert "steps=10->30" in recovered.stderr


@pytest.mark.cli
@pytest.mark.slow
def test_orphan_temp_dirs_are_removed_at_start(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    orphan = model_dir / "checkpoints" / "ckpt-30_temp"
    orphan.mkdir()
    (orphan / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"half a checkpoint")
    result = main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(orphan) in result.stderr and not orphan.exists()


def cut_short_in_the_merge(checkpoints: Path, name: str) -> None:
    """Makes the complete checkpoint `name` what a kill -9 inside TensorFlow's merge of its write
    leaves (the order a save's system calls show): its data file already moved out of
    `<name>_temp/`, its index half written in place, the folder still holding the part's index,
    and no state file entry for it."""
    index = checkpoints / f"{name}.index"
    partial = checkpoints / f"{name}_temp"
    partial.mkdir()
    (partial / "part-00000-of-00001.index").write_bytes(index.read_bytes())
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])


@pytest.mark.cli
@pytest.mark.slow
def test_a_kill_inside_the_first_checkpoints_merge_is_a_write_cut_short_and_the_rerun_starts_over(tmp_path):
    flags = ["--model=mlp", "--seed=5", "--train_steps=10", "--checkpoint_every=10"]
    whole = tmp_path / "whole"
    assert main_in_process(*flags, f"--model_dir={whole}").returncode == 0
    model_dir = copy_of(whole, tmp_path / "run")
    (model_dir / "checkpoints" / "checkpoint").unlink()  # The first save: no state file yet.
    cut_short_in_the_merge(model_dir / "checkpoints", "ckpt-10")

    rerun = main_in_process(*flags, f"--model_dir={model_dir}")

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "steps=0->10" in rerun.stderr  # Nothing was committed: the run starts over.
    assert f"removing {model_dir / 'checkpoints' / 'ckpt-10_temp'}" in rerun.stderr
    assert "removing ckpt-10.data-00000-of-00001, ckpt-10.index of the same write" in rerun.stderr
    assert not list(model_dir.rglob("*_temp")) and not (model_dir / "checkpoints" / "superseded").exists()
    reference = tf.train.load_checkpoint(str(whole / "checkpoints" / "ckpt-10"))
    written = tf.train.load_checkpoint(str(model_dir / "checkpoints" / "ckpt-10"))
    names = [name for name in reference.get_variable_to_shape_map() if name != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    assert names == [n for n in written.get_variable_to_shape_map() if n != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    for name in names:  # (The object graph holds the layers' names, numbered per process.)
        np.testing.assert_array_equal(reference.get_tensor(name), written.get_tensor(name), name)


@pytest.mark.cli
@pytest.mark.slow
def test_a_kill_after_the_first_checkpoints_index_but_before_its_folder_went_resumes_from_it(tmp_path):
    """The instant between the merged index's last byte and the folder's removal: `ckpt-10`
    is whole, so the rerun continues from it rather than starting over."""
    flags = ["--model=mlp", "--seed=5", "--checkpoint_every=10"]
    model_dir = tmp_path / "run"
    assert main_in_process(*flags, "--train_steps=10", f"--model_dir={model_dir}").returncode == 0
    checkpoints = model_dir / "checkpoints"
    (checkpoints / "checkpoint").unlink()
    partial = checkpoints / "ckpt-10_temp"
    partial.mkdir()
    (partial / "part-00000-of-00001.index").write_bytes((checkpoints / "ckpt-10.index").read_bytes())
    before = checkpoint_files(model_dir)

    rerun = main_in_process(*flags, "--train_steps=20", f"--model_dir={model_dir}")

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "steps=10->20" in rerun.stderr and not partial.exists()
    assert {name: checkpoint_files(model_dir)[name] for name in before} == before


@pytest.mark.cli
@pytest.mark.slow
def test_a_kill_inside_a_later_checkpoints_merge_resumes_from_the_one_before(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    checkpoints = model_dir / "checkpoints"
    # The state file as it was before the save of step 20: naming ckpt-10 alone.
    (checkpoints / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-10"\nall_model_checkpoint_paths: "ckpt-10"\n'
    )
    cut_short_in_the_merge(checkpoints, "ckpt-20")

    rerun = main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}")

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "steps=10->30" in rerun.stderr
    assert not list(model_dir.rglob("*_temp")) and not (checkpoints / "superseded").exists()
    assert discovery.read_problem(str(checkpoints / "ckpt-20")) is None


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("name", ["run[1]", "run*", "run?"])
def test_model_dir_with_pattern_characters_is_refused_and_siblings_untouched(trained, tmp_path, name):
    sibling = copy_of(trained, tmp_path / "run1")
    before = snapshot(sibling)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={tmp_path / name}"))
    assert name in line and "pattern" in line
    assert not (tmp_path / name).exists()
    assert snapshot(sibling) == before


# ------------------------------------------------------------- reruns, resume


@pytest.mark.cli
@pytest.mark.slow
def test_rerun_of_a_finished_run_leaves_metrics_json_and_says_where_it_is(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    before = snapshot(model_dir)
    result = main_in_process(*TRAINED_FLAGS, "--train_steps=20", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already at step 20" in result.stderr
    assert snapshot(model_dir) == before
    assert json.loads((model_dir / "metrics.json").read_text())["train"]  # not emptied


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--optimizer=sgd", "--lr_schedule=cosine", "--mixed_precision=bfloat16"])
def test_changed_optimizer_settings_on_resume_are_refused_naming_the_flag(trained, tmp_path, flag):
    model_dir = copy_of(trained, tmp_path / "run")
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", flag, f"--model_dir={model_dir}"))
    name, value = flag.split("=")
    assert f"{name}={value} differs from {name}=" in line and "--reset_optimizer" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
def test_reset_optimizer_keeps_the_weights_and_starts_fresh_optimizer_state(trained, tmp_path):
    import tensorflow as tf

    model_dir = copy_of(trained, tmp_path / "run")
    result = main_in_process(
        *TRAINED_FLAGS, "--train_steps=30", "--optimizer=sgd", "--reset_optimizer", f"--model_dir={model_dir}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps=20->30" in result.stderr
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / "ckpt-30"))
    assert reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 30
    assert not any("momentum" in name or "velocity" in name for name in reader.get_variable_to_shape_map())


# ------------------------------------------------ bad input: one line, exit 2, dir unchanged


def _write_hook_state(model_dir: Path, damage: str) -> None:
    target = model_dir / "hooks" / "early_stopping.json"
    if damage == "directory":
        target.unlink()
        target.mkdir()
    else:
        target.write_text({"garbage": "{not json", "empty": "", "wrong shape": "[1, 2, 3]"}[damage])


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage", "empty", "wrong shape", "directory"])
def test_damaged_hook_state_is_one_line_and_the_model_dir_is_left_alone(trained, tmp_path, damage):
    model_dir = copy_of(trained, tmp_path / "run")
    assert (model_dir / "hooks" / "early_stopping.json").is_file()
    _write_hook_state(model_dir, damage)
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}"))
    assert "early_stopping.json" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage", "wrong shape", "missing", "directory"])
def test_best_checkpoint_is_never_compared_against_nothing(trained, tmp_path, damage):
    model_dir = copy_of(trained, tmp_path / "run")
    best = model_dir / "best" / "best.json"
    assert json.loads(best.read_text())["metric"] == "accuracy"
    if damage == "missing":
        best.unlink()
    elif damage == "directory":
        best.unlink()
        best.mkdir()
    else:
        best.write_text("{not json" if damage == "garbage" else '{"metric": "accuracy"}')
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}"))
    assert "best.json" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
def test_changed_best_checkpoint_metric_is_refused(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    before = snapshot(model_dir)
    flags = [f for f in TRAINED_FLAGS if not f.startswith("--best_checkpoint_metric")]
    line = one_error_line(
        main_in_process(*flags, "--best_checkpoint_metric=loss", "--train_steps=30", f"--model_dir={model_dir}")
    )
    assert "by accuracy (max), not by loss (min)" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
    "flag",
    [
        "--epochs=nan",
        "--epochs=inf",
        "--seed=-1",
        f"--seed={2**40}",
        "--learning_rate=nan",
        "--learning_rate=inf",
        "--clip_norm=nan",
        "--clip_norm=inf",
        "--global_batch_size=1000000000",
        "--no_such_flag=1",
        "--train_steps=ten",
        "--flagfile=/nonexistent/flags.txt",
    ],
)
def test_bad_flags_are_one_line_and_exit_2_with_the_model_dir_left_alone(trained, tmp_path, flag):
    model_dir = copy_of(trained, tmp_path / "run")
    before = snapshot(model_dir)
    line = one_error_line(
        main_in_process(
            *[f for f in TRAINED_FLAGS if not f.startswith(flag.split("=")[0])], flag, f"--model_dir={model_dir}"
        )
    )
    assert flag.split("=")[0].lstrip("-") in line or flag.split("=")[1] in line, line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
def test_metrics_json_as_a_directory_is_refused_before_training(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    (model_dir / "metrics.json").unlink()
    (model_dir / "metrics.json").mkdir()
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}"))
    assert "metrics.json is a directory" in line
    assert snapshot(model_dir) == before


def _fake_mnist(path: Path, **override) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (256, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, 256).astype(np.uint8),
        "x_test": rng.integers(0, 256, (64, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, 64).astype(np.uint8),
    }
    arrays.update(override)
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / "mnist.npz", **arrays)
    return path


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
    "override, expected",
    [
        ({"x_train": np.zeros((256, 32, 32), np.uint8)}, "x_train is uint8 of shape (256, 32, 32)"),
        ({"y_test": np.zeros((63,), np.uint8)}, "y_test is uint8 of shape (63,)"),
        ({"y_train": np.r_[np.zeros(200, np.uint8), [10], np.zeros(55, np.uint8)]}, "y_train[200] = 10"),
    ],
)
def test_bad_mnist_file_is_one_line(trained, tmp_path, override, expected):
    model_dir = copy_of(trained, tmp_path / "run")
    # As an older run left it: with config.yaml, the change of --dataset is refused before the data is read.
    (model_dir / "config.yaml").unlink()
    before = snapshot(model_dir)
    data_dir = _fake_mnist(tmp_path / "mnist", **override)
    line = one_error_line(
        main_in_process(
            *TRAINED_FLAGS,
            "--dataset=mnist",
            f"--data_dir={data_dir}",
            "--train_steps=30",
            f"--model_dir={model_dir}",
        )
    )
    assert expected in line, line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.slow
def test_out_of_range_label_late_in_a_tfrecord_file_is_one_line(tmp_path):
    from input import write_tfrecords

    records = tmp_path / "records"
    records.mkdir()
    images = np.zeros((300, 28, 28, 1), np.uint8)
    labels = np.zeros(300, np.int64)
    labels[250] = 12
    write_tfrecords(str(records / "train-0.tfrecord"), images, labels)
    write_tfrecords(str(records / "eval-0.tfrecord"), images[:10], labels[:10])
    line = one_error_line(
        main_in_process(
            "--model=mlp",
            "--dataset=tfrecord",
            f"--data_dir={records}",
            "--train_steps=20",
            "--eval_every=0",
            "--global_batch_size=32",
            f"--model_dir={tmp_path / 'run'}",
        )
    )
    assert "label" in line and str(records) in line


# ----------------------------------------------------------------- bounded stop


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_sigterm_during_a_large_evaluation_stops_within_one_chunk(tmp_path):
    """60,000 eval images through wide_mlp take about a minute on 2 cores; the
    stop must come after one chunk of --steps_per_loop batches instead."""
    data_dir = _fake_mnist(
        tmp_path / "mnist", x_test=np.zeros((60000, 28, 28), np.uint8), y_test=np.zeros(60000, np.uint8)
    )
    model_dir = tmp_path / "run"
    process = popen_main(
        "--model=wide_mlp",
        "--dataset=mnist",
        f"--data_dir={data_dir}",
        "--global_batch_size=64",
        "--steps_per_loop=4",
        "--eval_every=4",
        "--train_steps=1000",
        f"--model_dir={model_dir}",
    )
    try:
        read_stderr_until(process, "step 4/", timeout=240)  # the first evaluation starts right after step 4
        time.sleep(3)  # well inside the evaluation
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        stopped_after = time.monotonic() - sent
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "evaluation at step 4 stopped by a stop request" in stderr
    assert stopped_after < 15, f"stop took {stopped_after:.1f} s"
    assert (model_dir / "checkpoints" / "ckpt-4.index").exists()


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_second_signal_ends_the_process_at_once(tmp_path):
    data_dir = _fake_mnist(tmp_path / "mnist")
    model_dir = tmp_path / "run"
    # One compiled loop of 5,000 wide_mlp steps: the first signal alone would wait for all of it.
    process = popen_main(
        "--model=wide_mlp",
        "--dataset=mnist",
        f"--data_dir={data_dir}",
        "--global_batch_size=64",
        "--steps_per_loop=5000",
        "--eval_every=0",
        "--checkpoint_every=100000",
        "--train_steps=100000",
        f"--model_dir={model_dir}",
    )
    try:
        read_stderr_until(process, "steps=0->", timeout=240)  # the banner: training starts next
        time.sleep(5)
        process.send_signal(signal.SIGTERM)
        time.sleep(1)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        ended_after = time.monotonic() - sent
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "received again: exiting now" in stderr
    assert ended_after < 5, f"took {ended_after:.1f} s"


# -------------------------------------------------------------------- full disk


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return mounted.returncode == 0


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_disk_is_one_line_and_the_previous_checkpoint_stays_latest(tmp_path):
    import tensorflow as tf

    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "2m"):
        pytest.skip("needs root and `mount -t tmpfs` to make a small disk")
    try:
        model_dir = disk / "run"
        # An mlp checkpoint is 1.2 MB (weights + Adam slots) beside 0.4 MB of TensorBoard
        # graph: the first checkpoint fits on the 2 MB disk, the second does not.
        flags = [
            "--model=mlp",
            "--steps_per_loop=2",
            "--checkpoint_every=2",
            "--eval_every=0",
            "--train_steps=6",
            f"--model_dir={model_dir}",
        ]
        line = one_error_line(run_main(*flags))
        assert "is full" in line and str(model_dir) in line, line
        latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
        assert latest is not None and discovery.read_problem(latest) is None
        assert not list((model_dir / "checkpoints").glob("*_temp"))
    finally:
        subprocess.run(
            ["umount", "--lazy", str(disk)], check=False
        )  # Lazy: files the test process still holds open


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_disk_under_a_background_write_and_the_best_checkpoint_leaves_no_partial_folder(tmp_path):
    """The best checkpoint's save (synchronous, at an evaluation) meets the full disk while the
    rolling checkpoint's background write fails on it too: the run ends on the first, and the
    second is never asked for its error. Neither may leave its ckpt-N_temp, nor a second line."""
    import tensorflow as tf

    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "4m"):
        pytest.skip("needs root and `mount -t tmpfs` to make a small disk")
    try:
        model_dir = disk / "run"
        flags = [
            "--model=mlp",
            "--steps_per_loop=2",
            "--checkpoint_every=2",
            "--eval_every=4",
            "--best_checkpoint_metric=accuracy",
            "--train_steps=40",
            f"--model_dir={model_dir}",
        ]
        result = run_main(*flags)
        line = one_error_line(result)
        assert "is full" in line and str(model_dir) in line, line
        assert "error" not in result.stderr.replace(line, ""), result.stderr[-3000:]  # Not a second time.
        assert not list(model_dir.rglob("*_temp")), sorted(model_dir.rglob("*"))
        latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
        assert latest is not None and discovery.read_problem(latest) is None
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_dir_made_read_only_mid_run_is_one_line_and_the_latest_checkpoint_stays(tmp_path):
    """Root writes through permissions: the run drops the capabilities that let it (setpriv)."""
    import shutil

    import tensorflow as tf

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without the capabilities that override permissions")
    model_dir = tmp_path / "run"
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    flags = ["--model=mlp", "--dataset=synthetic", "--steps_per_loop=10", "--checkpoint_every=20"]
    process = subprocess.Popen(
        [*drop, sys.executable, "-m", "engine.main", *flags, "--train_steps=100000", f"--model_dir={model_dir}"],
        cwd=REPO,
        env=python_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        wait_for_checkpoint(model_dir, process)
        subprocess.run(["chmod", "-R", "a-w", str(model_dir)], check=True)
        _, stderr = process.communicate(timeout=120)
    finally:
        stop(process)
        subprocess.run(["chmod", "-R", "u+w", str(model_dir)], check=False)
    line = one_error_line(subprocess.CompletedProcess(process.args, process.returncode, "", stderr))
    assert f"{model_dir} is not writable anymore" in line, line
    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert f"the latest checkpoint ({latest}) is kept" in line, line
    assert discovery.read_problem(latest) is None


# ------------------------------------------------------------- Trainer API


def test_trainer_refuses_a_model_dir_with_pattern_characters(tmp_path):
    with pytest.raises(UserError, match=r"contains '\[\]'"):
        make_trainer(model_dir=str(tmp_path / "run[0]"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cli
@pytest.mark.parametrize("flag", ["model_dir", "export_dir", "predict_output"])
def test_a_path_component_longer_than_the_file_system_allows_is_one_line_writing_nothing(tmp_path, flag):
    examples = tmp_path / "examples.npz"
    np.savez(examples, x=np.zeros((2, 8), np.float32))
    before = snapshot(tmp_path)
    predicting = flag == "predict_output"
    long = "a" * 300 + (".npy" if predicting else "")
    paths = {"model_dir": str(tmp_path / "run"), flag: str(tmp_path / long)}
    flags = ["--mode=predict", f"--predict_input={examples}"] if predicting else ["--train_steps=2"]
    result = main_in_process("--model=mlp", *flags, *(f"--{name}={p}" for name, p in paths.items()))
    line = one_error_line(result)
    assert f"--{flag}=... has a path component of {len(long)} bytes ('aaaa" in line, line
    assert "longer than the 255 its file system allows" in line, line
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["examples.npz"]


@pytest.mark.cli
@pytest.mark.slow
def test_checkpoint_files_the_state_does_not_list_are_moved_aside_not_overwritten(trained, tmp_path):
    import tensorflow as tf

    model_dir = copy_of(trained, tmp_path / "run")
    checkpoints = model_dir / "checkpoints"
    old = {name: content for name, (content, _) in checkpoint_files(model_dir).items() if "ckpt-20" in name}
    # An older state file put back: it names ckpt-10 only, while ckpt-20 is on disk.
    tf.compat.v1.train.update_checkpoint_state(
        str(checkpoints), str(checkpoints / "ckpt-10"), all_model_checkpoint_paths=[str(checkpoints / "ckpt-10")]
    )
    result = main_in_process(*TRAINED_FLAGS, "--train_steps=30", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps=10->30" in result.stderr and "did not list it" in result.stderr
    kept = {p.name: p.read_bytes() for p in (checkpoints / "superseded").rglob("ckpt-20*")}
    assert kept == old  # the earlier ckpt-20, byte for byte
    assert tf.train.latest_checkpoint(str(checkpoints)).endswith("ckpt-30")


@pytest.mark.cli
@pytest.mark.parametrize("damage", ["garbage", "missing"])
@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"optimizer": "sgd"}, "--optimizer=sgd differs"),  # Checked against checkpoints/settings.json.
        ({"best_checkpoint_metric": "loss"}, "not by loss"),  # Checked by the hook, after the Trainer.
        ({"model": "cnn"}, "does not match this model"),  # Checked by restoring the recovered latest.
    ],
    ids=["settings", "best-metric", "model"],
)
def test_a_refused_run_after_state_damage_leaves_the_model_dir_byte_identical(
    trained, tmp_path, damage, bad, expected
):
    """The state file is recovered (rewritten, the damaged one kept beside) to check the
    run; a check that refuses it afterwards takes every repair back."""
    from engine.cli.config.settings import RunConfig
    from engine.cli.run import job

    model_dir = copy_of(trained, tmp_path / "run")
    state = model_dir / "checkpoints" / model_dir_lib.STATE_FILE
    if damage == "garbage":
        state.write_bytes(b"\x00\xffnot a state file")
    else:
        state.unlink()
    before = file_tree(model_dir)
    settings = {
        "model": "mlp",
        "train_steps": 30,
        "checkpoint_every": 10,
        "eval_every": 10,
        "early_stop_metric": "loss",
        "early_stop_patience": 5,
        "best_checkpoint_metric": "accuracy",
        "model_dir": str(model_dir),
    }
    config = RunConfig(**{**settings, **bad})
    config.validate()
    with pytest.raises(UserError, match=expected):
        job.run(config)
    assert file_tree(model_dir) == before


def _run_in_process(model_dir: Path, **settings):
    """engine.cli.run.job.run on a RunConfig (what engine.main runs after parsing flags)."""
    from engine.cli.config.settings import RunConfig
    from engine.cli.run import job

    config = RunConfig(**{"model": "mlp", "eval_every": 0, "model_dir": str(model_dir), **settings})
    config.validate()
    return job.run(config)


@pytest.mark.cli
@pytest.mark.parametrize("name", ["checkpoints", "hooks", "train", "best"])
def test_a_subdirectory_replaced_by_a_file_is_one_line_and_nothing_changes(trained, tmp_path, name):
    import shutil

    model_dir = copy_of(trained, tmp_path / "run")
    shutil.rmtree(model_dir / name)
    (model_dir / name).write_bytes(b"not a directory")
    before = file_tree(model_dir)
    flags = {"checkpoint_every": 10, "eval_every": 10, "early_stop_metric": "loss", "early_stop_patience": 5}
    with pytest.raises(UserError) as raised:
        _run_in_process(model_dir, train_steps=30, best_checkpoint_metric="accuracy", **flags)
    message = str(raised.value)
    assert "\n" not in message and f"{model_dir / name} is a regular file, not a directory" in message, message
    assert file_tree(model_dir) == before


# ------------------------------------------------- a model_dir writes only inside itself


@pytest.mark.cli
def test_eval_of_a_model_dir_planted_with_temporary_links_leaves_their_target_untouched(trained, tmp_path):
    """A model_dir holding `metrics.json.tmp<pid> -> ~/.bashrc` made --mode=eval replace the
    user's file with metrics JSON (exit 0, no word) through the old predictable temporary."""
    victim = tmp_path / "bashrc"
    victim.write_text("the user's own file\n")
    model_dir = copy_of(trained, tmp_path / "run")
    pids = {*range(1, 2049), *range(os.getpid() - 16, os.getpid() + 2049)}  # In-process: this pid.
    for name in ("metrics.json", "config.yaml", "inputs.json"):
        for pid in pids:
            (model_dir / f"{name}.tmp{pid}").symlink_to(victim)
    result = main_in_process("--mode=eval", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert victim.read_text() == "the user's own file\n"
    metrics = model_dir / "metrics.json"
    assert not metrics.is_symlink() and json.loads(metrics.read_text())["evaluations"][-1]["mode"] == "eval"


@pytest.mark.cli
@pytest.mark.parametrize("name", ["checkpoints", "train", "best", "hooks", "diagnostics"])
def test_a_subdirectory_that_is_a_link_is_refused_naming_it_and_nothing_is_written(trained, tmp_path, name):
    """A `checkpoints -> elsewhere` link had a run write its checkpoints there, overwrite that
    directory's settings.json and rename its `checkpoint` file."""
    import shutil

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained / "checkpoints", elsewhere)
    model_dir = copy_of(trained, tmp_path / "run")
    if (model_dir / name).exists():
        shutil.rmtree(model_dir / name)
    (model_dir / name).symlink_to(elsewhere)
    before, elsewhere_before = file_tree(model_dir), file_tree(elsewhere)
    flags = {"checkpoint_every": 10, "eval_every": 10, "early_stop_metric": "loss", "early_stop_patience": 5}
    with pytest.raises(UserError) as raised:
        _run_in_process(model_dir, train_steps=30, best_checkpoint_metric="accuracy", **flags)
    message = str(raised.value)
    assert "\n" not in message and f"{model_dir / name} is a symbolic link (to {elsewhere})" in message, message
    assert file_tree(model_dir) == before and file_tree(elsewhere) == elsewhere_before


@pytest.mark.cli
def test_eval_into_an_eval_directory_that_is_a_link_is_one_line_and_writes_nothing(trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    model_dir = copy_of(trained, tmp_path / "run")
    subprocess.run(["rm", "-r", str(model_dir / "eval")], check=True)
    (model_dir / "eval").symlink_to(elsewhere)
    before = file_tree(model_dir)
    line = one_error_line(main_in_process("--mode=eval", f"--model_dir={model_dir}"))
    assert f"{model_dir / 'eval'} is a symbolic link (to {elsewhere})" in line, line
    assert file_tree(model_dir) == before and list(elsewhere.iterdir()) == []


@pytest.mark.cli
@pytest.mark.parametrize("mode", ["train", "eval", "predict"])
def test_a_config_yaml_that_is_a_link_is_refused_before_it_is_read(tmp_path, mode):
    """Read, it would bring settings from a file outside the model_dir; the first thing every
    mode reads, so it is refused before anything else."""
    elsewhere = tmp_path / "settings.yaml"
    elsewhere.write_text("model: cnn\n")
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "config.yaml").symlink_to(elsewhere)
    line = one_error_line(main_in_process(f"--mode={mode}", f"--model_dir={model_dir}"))
    assert f"{model_dir / 'config.yaml'} is a symbolic link (to {elsewhere})" in line, line
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.yaml"]


@pytest.mark.cli
def test_an_export_dir_among_other_files_is_refused_before_training(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("mine")
    model_dir = tmp_path / "run"
    line = one_error_line(
        main_in_process(*MLP, "--train_steps=2", f"--model_dir={model_dir}", f"--export_dir={home}")
    )
    assert f"--export_dir={home} holds files that are not an export (.bashrc)" in line, line
    assert sorted(p.name for p in home.iterdir()) == [".bashrc"] and not model_dir.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (mounted here, unmounted at the end) and a function that fills it.

    Not smaller: the first training run writes several MiB. Its TensorBoard graph of the train loop
    carries the function library of the whole process, as TensorFlow's trace export does: 0.5 MiB
    alone, 5.5 MiB after the in-process CLI tests of test_main.py, over 16 MiB after more test files
    ran first in one process. `fill` takes whatever is left, so the size only has to hold that run."""
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "64m"):
        pytest.skip("needs root and `mount -t tmpfs` to make a small disk")

    def fill() -> None:
        fd = os.open(disk / f"filler-{time.monotonic_ns()}", os.O_WRONLY | os.O_CREAT)
        try:
            for size in (65536, 1):  # Then the last partial block.
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * size)
        finally:
            os.close(fd)

    try:
        yield disk, fill
    finally:
        subprocess.run(
            ["umount", "--lazy", str(disk)], check=False
        )  # Lazy: files the test process still holds open


def _assert_full_disk_line(error: UserError, model_dir: Path) -> None:
    message = str(error)
    assert "\n" not in message and f"the disk holding {model_dir} is full" in message, message
    assert "MiB free" in message, message


def _latest_is_readable(model_dir: Path, step: int) -> None:
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert latest is not None and latest.endswith(f"ckpt-{step}"), latest
    assert discovery.read_problem(latest) is None


@pytest.mark.cli
def test_a_disk_full_at_start_or_in_eval_mode_is_one_line_and_changes_nothing(small_disk):
    disk, fill = small_disk
    model_dir = disk / "run"
    _run_in_process(model_dir, train_steps=10, checkpoint_every=10)
    fill()
    before = file_tree(model_dir)
    for settings in ({"train_steps": 20}, {"train_steps": 10, "mode": "eval"}):
        with pytest.raises(UserError) as raised:
            _run_in_process(model_dir, checkpoint_every=10, **settings)
        _assert_full_disk_line(raised.value, model_dir)
        # TensorFlow creates an event file before its first write fails: empty, it may stay.
        after = {name: kind for name, kind in file_tree(model_dir).items() if kind != (b"", "0o100644", 1)}
        assert after == {name: kind for name, kind in before.items() if kind != (b"", "0o100644", 1)}
    _latest_is_readable(model_dir, 10)


@pytest.mark.cli
def test_a_disk_that_fills_mid_run_is_one_line_and_the_previous_checkpoint_stays_latest(small_disk, monkeypatch):
    from engine.summaries import SummaryWriters

    disk, fill = small_disk
    model_dir = disk / "run"
    _run_in_process(model_dir, train_steps=10, checkpoint_every=10)
    write = SummaryWriters.write

    def filling_write(self, split, step, scalars):
        if step > 10:
            fill()  # Another process took the space: the event file's flush fails.
        write(self, split, step, scalars)

    monkeypatch.setattr(SummaryWriters, "write", filling_write)
    with pytest.raises(UserError) as raised:
        _run_in_process(model_dir, train_steps=40, checkpoint_every=40, log_every=5)
    _assert_full_disk_line(raised.value, model_dir)
    _latest_is_readable(model_dir, 10)


@pytest.mark.cli
def test_a_disk_full_during_the_best_checkpoint_save_keeps_the_old_best_pair(small_disk, monkeypatch):
    from engine.hooks.best_checkpoint import BestCheckpoint

    disk, fill = small_disk
    model_dir = disk / "run"
    evaluations = []
    on_eval_end = BestCheckpoint.on_eval_end

    def filling_on_eval_end(self, trainer, step, logs):
        evaluations.append(step)
        if len(evaluations) == 2:
            # Once step 10's checkpoint is whole: written in the background, it may still be in
            # flight on a busy machine, and a full disk would then end it instead (seen once).
            trainer.checkpointer.wait()
            fill()
        on_eval_end(self, trainer, step, logs)

    monkeypatch.setattr(BestCheckpoint, "on_eval_end", filling_on_eval_end)
    with pytest.raises(UserError) as raised:
        _run_in_process(
            model_dir, train_steps=30, checkpoint_every=10, eval_every=10, best_checkpoint_metric="loss"
        )
    _assert_full_disk_line(raised.value, model_dir)
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert best["checkpoint"] == "ckpt-10"  # The old pair: the record and the checkpoint it names.
    assert sorted(p.name for p in (model_dir / "best").glob("ckpt-*.index")) == ["ckpt-10.index"]
    assert discovery.read_problem(str(model_dir / "best" / "ckpt-10")) is None
    _latest_is_readable(model_dir, 10)  # The evaluation at 20 comes before its checkpoint.
