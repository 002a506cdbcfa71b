"""Checkpoints written in the background (`async_checkpoint`, on by default) keep the
guarantees of synchronous saves: the state file names a checkpoint only once its files
are complete, a checkpoint holds the values of its step, a full disk is the same one
line, the end of training waits for the write, and kill -9 at any moment of a write
leaves the latest checkpoint readable and the resume bitwise equal.

The fast tests hold the writer thread at a gate, so what "while the write is under way"
means is certain rather than timed; the kill -9 test runs the command line.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import python_env, run_main, small_trainer, stop

from engine.checkpointing import discovery
from engine.checkpointing.background import BackgroundWriter
from engine.errors import UserError
from engine.options import CheckpointOptions


@pytest.fixture
def gate(monkeypatch):
    """Open at first; after `gate.clear()` each background write waits until `gate.set()`.
    `gate.entered` is set once a write has started."""
    gate = threading.Event()
    gate.set()
    gate.entered = threading.Event()  # type: ignore[attr-defined]
    write = BackgroundWriter._write

    def held_write(self, step):
        gate.entered.set()  # type: ignore[attr-defined]
        assert gate.wait(60), "the test never opened the gate"
        write(self, step)

    monkeypatch.setattr(BackgroundWriter, "_write", held_write)
    return gate


def _state_names(model_dir: Path) -> str | None:
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    return None if path is None else os.path.basename(path)


def _weights(trainer) -> list[np.ndarray]:
    return [np.array(v) for v in trainer.model.get_weights()]


def _saved_weights(trainer, path: str) -> list[np.ndarray]:
    """The model weights a checkpoint holds, read into a fresh copy of the model."""
    import keras

    model = keras.models.clone_model(trainer.model)
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    return model.get_weights()


def test_a_save_returns_before_the_write_and_the_checkpoint_holds_the_step_it_was_taken_at(tmp_path, gate):
    trainer = small_trainer(tmp_path)
    assert trainer.checkpointer.writes_in_background
    trainer.train(2)  # ckpt-2, complete: the end of train() waited for it.
    assert _state_names(tmp_path) == "ckpt-2"
    trainer.train_runner.run(2, 2)  # Two more steps, no save.
    assert trainer.step == 4
    at_save = _weights(trainer)
    gate.clear()
    gate.entered.clear()
    trainer.save()  # Returns with the write held at the gate: the loop waits for the copy only.
    assert gate.entered.wait(30)
    # The write is under way: the state file still names the previous checkpoint.
    assert _state_names(tmp_path) == "ckpt-2"
    assert not (tmp_path / "checkpoints" / "ckpt-4.index").exists()
    trainer.train_runner.run(4, 2)  # Training goes on and changes the weights under the write.
    assert any(not np.array_equal(a, b) for a, b in zip(at_save, _weights(trainer), strict=True))
    gate.set()
    trainer.checkpointer.wait()
    assert _state_names(tmp_path) == "ckpt-4"
    saved = _saved_weights(trainer, str(tmp_path / "checkpoints" / "ckpt-4"))
    for a, b in zip(at_save, saved, strict=True):
        np.testing.assert_array_equal(a, b)  # The copy taken at the save, not the weights after it.
    trainer.close()


def test_the_state_file_names_a_checkpoint_only_once_its_files_are_complete(tmp_path, monkeypatch):
    trainer = small_trainer(tmp_path)
    manager = trainer.checkpoint_manager
    record_state = manager._record_state
    checked = []

    def checked_record_state():
        latest = manager.latest_checkpoint
        assert discovery.read_problem(latest) is None, f"{latest} named before its files are complete"
        assert not list((tmp_path / "checkpoints").glob("*_temp")), "the state file is written before the merge"
        checked.append((threading.current_thread().name, os.path.basename(latest)))
        record_state()

    monkeypatch.setattr(manager, "_record_state", checked_record_state)
    trainer.train(6)
    trainer.close()
    # TF records twice per save (before and after rotation), on the writer thread; the last
    # save of train() is waited for at once, so it is written on the loop's thread.
    assert [name for _, name in checked[::2]] == ["ckpt-2", "ckpt-4", "ckpt-6"], checked
    assert [thread.split("-")[0] for thread, _ in checked[::2]] == ["checkpoint", "checkpoint", "MainThread"]


def test_the_last_save_of_train_writes_the_weights_in_the_loop_and_later_saves_the_copy_again(tmp_path):
    trainer = small_trainer(tmp_path)
    started = []
    start = trainer.checkpointer._writer.start
    trainer.checkpointer._writer.start = lambda step: (started.append(step), start(step))
    trainer.train(4)  # ckpt-2 in the background (a copy), ckpt-4 in the loop (the weights themselves).
    assert started == [2]
    checkpoints = tmp_path / "checkpoints"
    at_4 = _weights(trainer)
    for a, b in zip(at_4, _saved_weights(trainer, str(checkpoints / "ckpt-4")), strict=True):
        np.testing.assert_array_equal(a, b)  # Not the copy taken at step 2.
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(at_4, _saved_weights(trainer, str(checkpoints / "ckpt-2")), strict=True)
    )
    trainer.train_runner.run(4, 2)
    at_6 = _weights(trainer)
    trainer.save()  # In the background again: the copy, taken now.
    assert started == [2, 6]
    trainer.train_runner.run(6, 2)
    trainer.checkpointer.wait()
    for a, b in zip(at_6, _saved_weights(trainer, str(checkpoints / "ckpt-6")), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.close()


def test_the_end_of_train_and_close_wait_for_the_write(tmp_path, monkeypatch):
    write = BackgroundWriter._write

    def slow_write(self, step):
        time.sleep(0.3)
        write(self, step)

    monkeypatch.setattr(BackgroundWriter, "_write", slow_write)
    trainer = small_trainer(tmp_path)
    trainer.train(4)
    assert _state_names(tmp_path) == "ckpt-4"
    assert discovery.read_problem(str(tmp_path / "checkpoints" / "ckpt-4")) is None
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    trainer.save()  # The same step again, then close(): it ends complete too.
    trainer.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    assert _state_names(tmp_path) == "ckpt-4"


def _disk_full(monkeypatch, *, after: int) -> None:
    """Every CheckpointManager.save after the first `after` fails as a full disk does."""
    save = tf.train.CheckpointManager.save
    calls = []

    def full_save(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            os.makedirs(os.path.join(self.directory, "ckpt-99_temp"), exist_ok=True)  # What a cut write leaves.
            raise tf.errors.ResourceExhaustedError(
                None, None, "ckpt-99_temp/part-00000; No space left on device"
            )
        return save(self, *args, **kwargs)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", full_save)


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_a_disk_full_during_a_write_is_the_sync_line_and_the_previous_checkpoint_stays_latest(
    tmp_path, monkeypatch, background
):
    trainer = small_trainer(tmp_path, checkpoint=CheckpointOptions(async_checkpoint=background))
    assert trainer.checkpointer.writes_in_background is background
    _disk_full(monkeypatch, after=1)
    with pytest.raises(UserError) as raised:
        trainer.train(6)
    message = str(raised.value)
    assert "\n" not in message, message
    assert re.fullmatch(
        rf"checkpoint at step 4 not saved: the disk holding {re.escape(str(tmp_path / 'checkpoints'))} is full "
        r"\(.* MiB free of .* MiB\); free space or use another `model_dir`; the latest checkpoint "
        rf"\({re.escape(str(tmp_path / 'checkpoints' / 'ckpt-2'))}\) is kept",
        message,
    ), message
    assert _state_names(tmp_path) == "ckpt-2"
    assert discovery.read_problem(str(tmp_path / "checkpoints" / "ckpt-2")) is None
    assert not list((tmp_path / "checkpoints").glob("*_temp"))
    trainer.close()


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_a_model_dir_made_read_only_between_the_files_and_the_state_file_names_what_a_rerun_resumes(
    tmp_path, monkeypatch, background
):
    """`chmod -R a-w` can land after a checkpoint's files and before the state file: the
    manager then counts the new checkpoint, but a rerun resumes from the one the state
    file names, and that one is what the line must call kept (CI found it so)."""
    save = tf.train.CheckpointManager.save
    state_file = tmp_path / "checkpoints" / "checkpoint"
    calls = []

    def denied_state_write(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            return save(self, *args, **kwargs)
        before = state_file.read_bytes()
        save(self, *args, **kwargs)  # The files, then the state file as it was: the write denied.
        state_file.write_bytes(before)
        raise tf.errors.PermissionDeniedError(None, None, f"{state_file}.tmp; Permission denied")

    monkeypatch.setattr(tf.train.CheckpointManager, "save", denied_state_write)
    trainer = small_trainer(tmp_path, checkpoint=CheckpointOptions(async_checkpoint=background))
    with pytest.raises(UserError) as raised:
        trainer.train(6)
    kept = tmp_path / "checkpoints" / "ckpt-2"
    assert str(raised.value) == (
        f"checkpoint at step 4 not saved: {tmp_path} is not writable anymore; "
        f"the latest checkpoint ({kept}) is kept: rerun to continue from it"
    )
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")) == str(kept)
    trainer.close()


def test_a_failed_background_write_removes_its_own_partial_folder_at_once(tmp_path, monkeypatch):
    """The run may end before anything claims the write's error (a full disk fails the best
    checkpoint's save first, and the process exits): its folder must not wait for that."""
    trainer = small_trainer(tmp_path)
    trainer.train(2)
    save = tf.train.CheckpointManager.save

    def cut_short(self, checkpoint_number):
        partial = os.path.join(self.directory, f"ckpt-{checkpoint_number}_temp")
        os.makedirs(partial)  # What TensorFlow's write leaves when the disk fills.
        with open(os.path.join(partial, "part-00000-of-00001.data-00000-of-00001.tempstate1"), "wb") as handle:
            handle.write(b"half")
        raise tf.errors.ResourceExhaustedError(None, None, f"{partial}/part-00000; No space left on device")

    monkeypatch.setattr(tf.train.CheckpointManager, "save", cut_short)
    trainer.global_step.assign(4)
    trainer.save()
    trainer.checkpointer._writer._thread.join()  # The write ended; nothing has asked for its result.
    assert not (tmp_path / "checkpoints" / "ckpt-4_temp").exists()
    with pytest.raises(UserError, match=r"checkpoint at step 4 not saved: the disk holding .* is full"):
        trainer.close()
    monkeypatch.setattr(tf.train.CheckpointManager, "save", save)
    assert _state_names(tmp_path) == "ckpt-2"


def test_async_checkpoint_off_saves_in_the_loop(tmp_path):
    trainer = small_trainer(tmp_path, checkpoint=CheckpointOptions(async_checkpoint=False))
    assert not trainer.checkpointer.writes_in_background
    trainer.train(2)
    assert _state_names(tmp_path) == "ckpt-2"


# --------------------------------------------------------------- kill -9 during writes

# A small mlp beside a 64 MiB weight that nothing trains: each write takes a while, steps stay fast.
BALLAST_MODEL = """
import keras
from keras import layers


def build(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)
    x = layers.Dense(64, activation="relu")(layers.Flatten()(inputs))
    model = keras.Model(inputs, layers.Dense(num_classes, dtype="float32")(x))
    model.ballast = model.add_weight(shape=(4096, 4096), initializer="ones", trainable=False, name="ballast")
    return model
"""

KILL_FLAGS = [
    "--model=ballast:build",
    "--deterministic",
    "--optimizer=adam",
    "--eval_every=0",
    "--steps_per_loop=5",
    "--checkpoint_every=20",
    "--seed=7",
    "--max_checkpoints=2",
]


def _final_state(model_dir: Path) -> dict[str, np.ndarray]:
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if "save_counter" not in name
    }


def _write_under_way(checkpoints: Path, beyond: int, since_ns: int) -> bool:
    """Whether a write of a checkpoint past step `beyond` has begun since `since_ns` (its `_temp`
    directory, or its files before the state file names them). Not what an earlier kill left
    there: seen at once, those made the next run's kill land in its start-up."""
    for path in checkpoints.glob("ckpt-*"):
        match = re.match(r"ckpt-(\d+)", path.name)
        if match and int(match.group(1)) > beyond:
            try:
                if path.stat().st_mtime_ns >= since_ns:
                    return True
            except FileNotFoundError:  # Removed as an orphan, or renamed, meanwhile.
                continue
    return False


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_during_background_writes_then_resume_bitwise_equal(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "ballast.py").write_text(BALLAST_MODEL)
    target = 400
    flags = [*KILL_FLAGS, f"--train_steps={target}"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = run_main(*flags, f"--model_dir={whole}", cwd=project, timeout=400)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    rng = random.Random(22)
    # One kill in each third of the 0-250 ms after a write begins (a random moment inside it, the
    # thirds in a random order): the three cover the whole window, which holds every phase of the
    # write (copy, files, merge, state file).
    windows = rng.sample(range(3), 3)
    deadline = time.monotonic() + 480
    kills = 0
    for window in windows:
        if time.monotonic() > deadline:
            break
        resumed_from = _latest(killed)
        started_ns = time.time_ns()
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.main", *flags, f"--model_dir={killed}"],
            cwd=project,
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            process_group=0,
        )
        try:
            waited = time.monotonic() + 120
            while not _write_under_way(killed / "checkpoints", resumed_from, started_ns):
                assert process.poll() is None, process.communicate(timeout=30)[1][-3000:]
                assert time.monotonic() < waited, "no checkpoint write began in 120 s"
                time.sleep(0.002)
            time.sleep(rng.uniform(window * 0.25 / 3, (window + 1) * 0.25 / 3))  # Its third of the write.
            if process.poll() is not None:
                break  # The run finished first: nothing left to kill.
        finally:
            stop(process)  # SIGKILL to the group: no handler, no atexit.
        kills += 1
        latest = tf.train.latest_checkpoint(str(killed / "checkpoints"))
        if latest is not None:
            assert discovery.read_problem(latest) is None, f"kill {kills}: {latest} cannot be read"
    assert kills >= 3, f"only {kills} kills landed before the run ended"
    assert (_latest(killed) or 0) < target
    finished = run_main(*flags, f"--model_dir={killed}", cwd=project, timeout=400)
    assert finished.returncode == 0, finished.stderr[-3000:]
    final = _final_state(whole)
    assert any("ballast" in name or "optimizer" in name for name in final)
    resumed = _final_state(killed)
    assert final.keys() == resumed.keys()
    for name in final:
        np.testing.assert_array_equal(final[name], resumed[name], err_msg=name)


def _latest(model_dir: Path) -> int:
    """The step of the latest checkpoint, -1 without one."""
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    return -1 if path is None else int(path.rsplit("-", 1)[1])


# Research code (README "Embedding the loop"): the library's Trainer, no command line, no writer
# lock of its own; a small model beside a 64 MiB weight, so that each write takes a while.
RESEARCH_SCRIPT = """
import sys

import engine
import keras
import numpy as np
import tensorflow as tf

model_dir, steps = sys.argv[1], int(sys.argv[2])
strategy = tf.distribute.get_strategy()
inputs = keras.Input(shape=(8,))
model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
model.ballast = model.add_weight(shape=(4096, 4096), initializer="ones", trainable=False, name="ballast")
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype("int32"))).repeat().batch(32)
trainer = engine.Trainer(  # raw Trainer: research code's own script, as the README embeds the loop
    strategy=strategy,
    model=model,
    optimizer=keras.optimizers.SGD(0.1),
    train_data=data,
    global_batch_size=32,
    loss_fn=lambda labels, logits: tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits),
    model_dir=model_dir,
    cadence=engine.Cadence(steps_per_loop=5, checkpoint_every=5),
)
print("restored step", trainer.step, flush=True)
trainer.train(steps)
trainer.close()
"""


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_9_during_a_background_write_then_a_library_restart_leaves_no_partial_folder(tmp_path):
    script = tmp_path / "research.py"
    script.write_text(RESEARCH_SCRIPT)
    model_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    partial: list[str] = []
    for _ in range(5):  # A write may end between the look and the kill: try again.
        process = subprocess.Popen(
            [sys.executable, str(script), str(model_dir), "100000"],
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            process_group=0,
        )
        try:
            waited = time.monotonic() + 120
            # A write after the first checkpoint: the kill must leave that one the latest, readable.
            while "checkpoint" not in _listed(checkpoints) or not (
                partial := [n for n in _listed(checkpoints) if n.endswith("_temp")]
            ):
                assert process.poll() is None, process.communicate(timeout=30)[1][-3000:]
                assert time.monotonic() < waited, "no checkpoint write began in 120 s"
                time.sleep(0.001)
        finally:
            stop(process)  # SIGKILL to the group: no handler, no atexit.
        if [n for n in _listed(checkpoints) if n.endswith("_temp")]:
            break
    assert partial and (checkpoints / partial[0]).is_dir(), "no kill landed during a write"
    latest = tf.train.latest_checkpoint(str(checkpoints))
    assert latest is not None

    restart = subprocess.run(
        [sys.executable, str(script), str(model_dir), "0"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert restart.returncode == 0, restart.stderr[-3000:]
    assert f"restored step {int(latest.rsplit('-', 1)[1])}" in restart.stdout
    assert not [path for path in model_dir.rglob("*_temp")], sorted(_listed(checkpoints))
    assert discovery.read_problem(latest) is None


def _listed(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
