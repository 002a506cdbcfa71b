"""Nothing lost: bitwise resume, kill -9, SIGTERM/SIGINT, bad checkpoints and data.

Every test runs the real command line in subprocesses with timeouts, but for the
refusals of a bad checkpoint or bad data (and the --restore_fallback run after one),
which run it in-process (`helpers.main_in_process`) on a copy of a model_dir trained
in-process too, and the restarts after a signal (20 steps, in-process).
"""

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    REPO,
    UNTIL_STOPPED,
    copy_of,
    in_background,
    latest_step,
    main_in_process,
    one_error_line,
    popen_main,
    read_stderr_until,
    run_main,
    snapshot,
    stop,
    wait_for_checkpoint,
)

RESUME_FLAGS = [
    "--model=mlp",
    "--deterministic",
    "--optimizer=adam",
    "--eval_every=0",
    "--steps_per_loop=7",
    "--checkpoint_every=10",
    "--seed=7",
]


def final_state(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the latest checkpoint: weights, optimizer slots, step."""
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if not name.startswith("save_counter")
    }  # bookkeeping of how many saves ran


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert any("optimizer" in name for name in a)  # slots are compared too
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.process
@pytest.mark.timeout(900)
def test_kill_9_at_random_moments_then_resume_bitwise_equal(tmp_path):
    """A run that ends at --train_steps=23 (the default strategy), continued with more steps, killed
    twice at random moments and finished: bitwise the uninterrupted run of all the steps. (The same
    clean stop under MirroredStrategy: the two_headed case of the real models' test below.)"""
    # 1,200 steps run for some 2.5 s past the first checkpoint (~470 steps/s on 2 quiet cores); the
    # two kills come 0-1 s after a checkpoint (seeded: 0.97 s, then 0.44 s, near steps 500 and 730),
    # so each lands in the middle of training, never in the import or after the end. A checkpoint
    # comes every 20 steps (~40 ms): either delay falls anywhere in its cycle, writes included.
    target = 1200
    flags = [*RESUME_FLAGS, f"--train_steps={target}", "--checkpoint_every=20", "--steps_per_loop=5"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = in_background(run_main, *flags, f"--model_dir={whole}", timeout=400)  # beside the kills
    # Stopped at its own end, between loops of 5 and checkpoints of 20 (its last loop 3 steps).
    stopped = run_main(*flags, "--train_steps=23", f"--model_dir={killed}")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert latest_step(killed) == 23
    rng = random.Random(1234)
    step = 23
    for round_ in range(2):
        process = popen_main(*flags, f"--model_dir={killed}")
        try:
            if round_ == 0:  # The clean stop's continuation, with more steps.
                read_stderr_until(process, f"steps=23->{target}", timeout=240)
            wait_for_checkpoint(killed, process, beyond=step)  # a checkpoint of this run, not the last one's
            time.sleep(rng.uniform(0.0, 1.0))  # anywhere, checkpoint writes included
            assert process.poll() is None, "the run ended before the kill"
        finally:
            stop(process)  # SIGKILL: no handler runs
        step = latest_step(killed)
        assert step is not None and step < target, step  # killed while training
    finished = run_main(*flags, f"--model_dir={killed}", timeout=400)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert uninterrupted.result().returncode == 0
    resumed_from = int(re.search(rf"steps=(\d+)->{target}", finished.stderr).group(1))
    assert 0 < resumed_from < target and resumed_from % 20 == 0, resumed_from  # it resumed, then trained
    assert_bitwise_equal(final_state(whole), final_state(killed))


@pytest.mark.process
@pytest.mark.timeout(480)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_exits_then_restart_continues(tmp_path, signum):
    process = popen_main(*UNTIL_STOPPED, f"--model_dir={tmp_path}")
    try:
        read_stderr_until(process, "step 20/", timeout=240)  # training is under way
        sent = time.monotonic()
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
        assert time.monotonic() - sent < 30
    finally:
        stop(process)
    assert process.returncode == 128 + signum, stderr[-3000:]
    saved = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    assert saved is not None
    step = int(saved.rsplit("-", 1)[1])
    assert step > 0 and step % 20 == 0 and f"stopped at step {step}" in stderr
    restarted = main_in_process(  # 20 steps: the restart's resume, in this process
        "--model=mlp", f"--train_steps={step + 20}", "--eval_every=0", f"--model_dir={tmp_path}"
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"steps={step}->{step + 20}" in restarted.stderr


@pytest.fixture(scope="module")
def trained_mlp_dir(tmp_path_factory) -> Path:
    """A model_dir with mlp checkpoints at steps 10 and 20 (20 steps, trained in-process)."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    result = main_in_process(
        "--model=mlp", "--train_steps=20", "--checkpoint_every=10", "--eval_every=0", f"--model_dir={model_dir}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir


@pytest.mark.cli
def test_checkpoint_of_another_model_is_refused_and_left_alone(trained_mlp_dir, tmp_path):
    model_dir = copy_of(trained_mlp_dir, tmp_path / "run")
    # As an older run left it: without config.yaml, whose check (tests/cli/test_config_file.py) comes first.
    (model_dir / "config.yaml").unlink()
    before = snapshot(model_dir)
    line = one_error_line(main_in_process("--model=cnn", "--train_steps=30", f"--model_dir={model_dir}"))
    assert "ckpt-20 does not match this model" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
def test_truncated_checkpoint_is_named_and_fallback_restores_the_previous(trained_mlp_dir, tmp_path):
    model_dir = copy_of(trained_mlp_dir, tmp_path / "run")
    data_file = next((model_dir / "checkpoints").glob("ckpt-20.data-*"))
    truncated = data_file.read_bytes()[:50]
    data_file.write_bytes(truncated)
    before = snapshot(model_dir)
    common = [
        "--model=mlp",
        "--train_steps=30",
        "--checkpoint_every=10",
        "--eval_every=0",
        f"--model_dir={model_dir}",
    ]
    line = one_error_line(main_in_process(*common))
    assert "ckpt-20 cannot be read" in line and "--restore_fallback" in line
    assert snapshot(model_dir) == before

    recovered = main_in_process(*common, "--restore_fallback")
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert "steps=10->30" in recovered.stderr
    kept = model_dir / "checkpoints" / "unreadable" / data_file.name
    assert kept.read_bytes() == truncated  # moved aside, not deleted
    assert tf.train.latest_checkpoint(str(model_dir / "checkpoints")).endswith("ckpt-30")


@pytest.mark.cli
def test_bad_data_is_named_and_model_dir_left_alone(trained_mlp_dir, tmp_path):
    from input import write_tfrecords

    model_dir = copy_of(trained_mlp_dir, tmp_path / "run")
    # As an older run left it: with config.yaml, the change of --dataset is refused before the data is read.
    (model_dir / "config.yaml").unlink()
    before = snapshot(model_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(
        main_in_process("--model=mlp", "--dataset=tfrecord", f"--data_dir={empty}", f"--model_dir={model_dir}")
    )
    assert str(empty) in line
    records = tmp_path / "records"
    records.mkdir()
    images = np.zeros((4, 28, 28, 1), np.uint8)
    write_tfrecords(str(records / "train-0.tfrecord"), images, np.arange(4))
    (records / "train-1.tfrecord").write_bytes(os.urandom(300))
    line = one_error_line(
        main_in_process("--model=mlp", "--dataset=tfrecord", f"--data_dir={records}", f"--model_dir={model_dir}")
    )
    assert "train-1.tfrecord" in line
    assert snapshot(model_dir) == before


BEST_FLAGS = [
    "--model=mlp",
    "--deterministic",
    "--seed=3",
    "--train_steps=80",
    "--steps_per_loop=5",
    "--eval_every=10",
    "--checkpoint_every=10",
    "--best_checkpoint_metric=loss",
]


def _best_record(model_dir: Path) -> dict | None:
    path = model_dir / "best" / "best.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.process
@pytest.mark.timeout(600)
def test_kill_9_around_a_best_checkpoint_save_never_leaves_best_json_naming_what_best_lacks(tmp_path):
    """Killed 0-30 ms after the evaluation that makes a new best is logged (inside the
    best checkpoint's save); each rerun continues from there and is killed at the next
    new best; the last one finishes with the uninterrupted run's best."""
    from engine.checkpointing import discovery

    reference = tmp_path / "reference"
    done = run_main(*BEST_FLAGS, f"--model_dir={reference}")
    assert done.returncode == 0, done.stderr[-3000:]
    best_steps = [int(s) for s in re.findall(r"best eval loss=\S+ at step (\d+)", done.stderr)]
    assert len(best_steps) >= 6, done.stderr[-3000:]  # A new best at (nearly) every evaluation.
    model_dir = tmp_path / "run"
    for delay_ms, step in zip([0, 3, 8, 15, 30], best_steps[1:], strict=False):
        process = popen_main(*BEST_FLAGS, f"--model_dir={model_dir}")
        try:
            read_stderr_until(process, f"eval at step {step} ", timeout=240)
            time.sleep(delay_ms / 1000)
        finally:
            stop(process)  # kill -9
        record = _best_record(model_dir)
        assert record is not None  # An earlier best was committed.
        named = model_dir / "best" / record["checkpoint"]
        assert discovery.read_problem(str(named)) is None, (delay_ms, record, os.listdir(named.parent))
    finished = run_main(*BEST_FLAGS, f"--model_dir={model_dir}")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _best_record(model_dir) == _best_record(reference)
    kept = sorted(p.name for p in (model_dir / "best").glob("ckpt-*.index"))
    assert kept == [_best_record(reference)["checkpoint"] + ".index"]
    reference_best = tf.train.load_checkpoint(str(reference / "best" / kept[0][: -len(".index")]))
    resumed_best = tf.train.load_checkpoint(str(model_dir / "best" / kept[0][: -len(".index")]))
    for name in reference_best.get_variable_to_shape_map():
        if "save_counter" not in name:
            np.testing.assert_array_equal(reference_best.get_tensor(name), resumed_best.get_tensor(name), name)


REAL_MODELS = """
import keras


def dropout_cnn(input_shape, num_outputs):
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.SpatialDropout2D(0.2),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(num_outputs),
        ]
    )


def gru_tagger(input_shape, num_outputs):
    tokens = keras.Input(input_shape)
    hidden = keras.layers.Embedding(40, 8, mask_zero=True)(tokens)
    hidden = keras.layers.GRU(8, return_sequences=True, dropout=0.1)(hidden)
    return keras.Model(tokens, keras.layers.Dense(num_outputs)(hidden))


def two_headed(input_shape, num_outputs):
    images = keras.Input(input_shape)
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(images))
    hidden = keras.layers.Dropout(0.2)(hidden)
    heads = [keras.layers.Dense(num_outputs)(hidden), keras.layers.Dense(num_outputs)(hidden)]
    return keras.Model(images, heads)
"""


def padded_tags(path: Path) -> None:
    """Sequences of token ids padded with 0 to 10, a tag (0..4) for each token."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, 40, size=(600, 10))
    for row, length in enumerate(rng.integers(2, 11, size=600)):
        tokens[row, length:] = 0
    np.savez(path, x_train=tokens.astype(np.int32), y_train=(tokens % 5).astype(np.int32))


@pytest.mark.process
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "model, data, stop_at",
    [
        ("dropout_cnn", ["--dataset=digits"], None),
        ("gru_tagger", ["--dataset=TAGS", "--loss=sparse_categorical_crossentropy"], None),
        ("two_headed", ["--dataset=digits"], 25),
    ],
)
def test_real_models_from_the_command_line_resume_bitwise_after_kill_9(tmp_path, model, data, stop_at):
    """A Dropout CNN, a masked GRU tagger and a model of two heads (issue 28), each the user's
    --model on two replicas, killed with SIGKILL after a checkpoint and run again: the end is
    bitwise the uninterrupted run's, random state and optimizer slots included. With `stop_at`,
    the run first ends at --train_steps=stop_at and is continued with more steps (a clean stop
    under MirroredStrategy; the default strategy's is in the kill -9 test above)."""
    (tmp_path / "real_models.py").write_text(REAL_MODELS)
    padded_tags(tmp_path / "tags.npz")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}  # The user's module beside this checkout.
    flags = [
        f"--model=real_models:{model}",
        *(flag.replace("TAGS", str(tmp_path / "tags.npz")) for flag in data),
        "--strategy=mirrored",
        "--cpu_devices=2",
        "--global_batch_size=32",
        "--optimizer=adam",
        "--train_steps=200",  # 180 steps (seconds) past the checkpoint the kill follows
        "--checkpoint_every=20",
        "--steps_per_loop=10",
        "--eval_every=0",
        "--deterministic",
    ]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = in_background(run_main, *flags, f"--model_dir={whole}", env=env, timeout=400)
    if stop_at is not None:  # Its last loop cut short: 25 is no multiple of 10.
        stopped = run_main(*flags, f"--train_steps={stop_at}", f"--model_dir={killed}", env=env, timeout=400)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert latest_step(killed) == stop_at
    process = popen_main(*flags, f"--model_dir={killed}", env=env)
    try:
        if stop_at is not None:
            read_stderr_until(process, f"steps={stop_at}->200", timeout=240)
        wait_for_checkpoint(killed, process, beyond=stop_at or -1)
        assert process.poll() is None, "the run ended before the kill"
    finally:
        stop(process)  # SIGKILL: no handler runs
    finished = run_main(*flags, f"--model_dir={killed}", env=env, timeout=400)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert uninterrupted.result().returncode == 0
    resumed_from = int(re.search(r"steps=(\d+)->200", finished.stderr).group(1))
    assert (stop_at or 0) < resumed_from < 200, resumed_from
    state = final_state(killed)
    assert any("random_state" in name for name in state)  # The dropout masks' seeds were saved.
    assert_bitwise_equal(final_state(whole), state)
