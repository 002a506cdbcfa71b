"""Errors that only show once training runs, after every up-front check passed: a TFRecord
record whose bytes fail their checksum (the framing is checked at start-up, the data is not),
an allocation that does not fit in the compiled step, and a model_dir removed, replaced or made
unwritable under the run. Each is one line naming what to change, exit 2, and nothing saved
after it: the checkpoint before it stays the latest (where it is still there)."""

from __future__ import annotations

import shutil
import struct
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import main_in_process, one_error_line, snapshot

from engine.loop.runners import TrainRunner
from input import write_tfrecords

FLAGS = ["--model=mlp", "--dataset=tfrecord", "--global_batch_size=4", "--mode=train", "--steps_per_loop=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir trained to ckpt-2 on two TFRecord files; train-1 is the longer one."""
    root = tmp_path_factory.mktemp("trained")
    rng = np.random.RandomState(0)
    images, labels = rng.randint(0, 256, (16, 28, 28, 1)).astype(np.uint8), rng.randint(0, 10, 16)
    write_tfrecords(str(root / "data" / "train-0"), images[:4], labels[:4])
    write_tfrecords(str(root / "data" / "train-1"), images[4:], labels[4:])
    result = main_in_process(
        *FLAGS, f"--data_dir={root / 'data'}", "--train_steps=2", f"--model_dir={root / 'run'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture
def copy(trained, tmp_path):
    shutil.copytree(trained / "data", tmp_path / "data")
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path


def _flip_a_byte_of_the_last_record(path) -> int:
    """Damages the data of the file's last record, its framing intact; returns the offset of its
    data (after the 12-byte header), where TF's reader says the corrupted record is."""
    data = bytearray(path.read_bytes())
    offset = last = 0
    while offset < len(data):
        last = offset
        offset += 12 + struct.unpack("<Q", data[offset : offset + 8])[0] + 4
    data[last + 12 + 20] ^= 0xFF
    path.write_bytes(bytes(data))
    return last + 12


@pytest.mark.cli
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_a_record_that_fails_its_checksum_mid_run_is_one_line_naming_its_file(copy):
    damaged = copy / "data" / "train-1"
    offset = _flip_a_byte_of_the_last_record(damaged)
    assert offset > (copy / "data" / "train-0").stat().st_size  # Only train-1 can hold it.
    checkpoints = snapshot(copy / "run" / "checkpoints")

    result = main_in_process(
        *FLAGS, f"--data_dir={copy / 'data'}", "--train_steps=6", f"--model_dir={copy / 'run'}"
    )

    line = one_error_line(result)
    assert f"damaged data in TFRecord file {damaged} (corrupted record at {offset})" in line, line
    assert "copy the file again or remove it from --data_dir" in line
    assert f"the latest checkpoint ({copy / 'run' / 'checkpoints' / 'ckpt-2'}) is kept" in line, line
    assert snapshot(copy / "run" / "checkpoints") == checkpoints


def _fails_on_the_second_loop(error: Exception):
    """The compiled loop as it runs, except that its second call raises `error`, as TF does."""
    real = TrainRunner._call
    calls = []

    def run_train_loop(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(self, *args, **kwargs)

    return run_train_loop


OOM = (
    "Graph execution error:\n\nDetected at node sequential/dense/MatMul defined at (most recent call last):\n"
    '  File "engine/loop/steps.py", line 1, in step\n\n'
    "OOM when allocating tensor with shape[4,784] and type float on /job:localhost/replica:0/task:0/"
    "device:GPU:0 by allocator GPU_0_bfc\n\t [[{{node sequential/dense/MatMul}}]]\n"
    "Hint: If you want to see a list of allocated tensors when OOM happens, add "
    "report_tensor_allocations_upon_oom to RunOptions for current allocation info.\n"
    " [Op:__inference_train_loop_1]"
)


@pytest.mark.cli
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_an_out_of_memory_in_the_compiled_step_is_one_line_naming_the_batch(copy, monkeypatch):
    """Injected: a real OOM needs a device to fill (the CPU allocator does not report one)."""
    error = tf.errors.ResourceExhaustedError(None, None, OOM)
    monkeypatch.setattr(TrainRunner, "_call", _fails_on_the_second_loop(error))
    flags = [*FLAGS, f"--data_dir={copy / 'data'}", "--train_steps=8", "--checkpoint_every=2"]

    line = one_error_line(main_in_process(*flags, f"--model_dir={copy / 'run'}"))

    assert "out of memory training --model=mlp at --global_batch_size=4 (4 examples per micro-batch" in line
    assert "OOM when allocating tensor with shape[4,784]" in line and "Hint" not in line, line
    assert "use a smaller --global_batch_size, or a larger --grad_accum_steps" in line
    # The first loop (steps 2-4) saved; nothing after the error did.
    assert f"the latest checkpoint ({copy / 'run' / 'checkpoints' / 'ckpt-4'}) is kept" in line, line
    assert tf.train.latest_checkpoint(str(copy / "run" / "checkpoints")).endswith("ckpt-4")

    # Exactly that: a full disk (an event file's flush) is not a batch too large: it gets the
    # full-disk line (engine.model_dir.disk_full_message), not the out-of-memory one.
    full = tf.errors.ResourceExhaustedError(None, None, "Could not flush events file: No space left on device")
    monkeypatch.undo()
    monkeypatch.setattr(TrainRunner, "_call", _fails_on_the_second_loop(full))
    line = one_error_line(main_in_process(*flags, f"--model_dir={copy / 'run'}"))
    assert "is full" in line and "out of memory" not in line, line


def _model_dir_lost(run, how: str):
    """The compiled loop as it runs, except that before its second call the model_dir is removed
    or replaced by a file (`how`), as another user or tool might."""
    real = TrainRunner._call
    calls = []

    def run_train_loop(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            # A background write of the last checkpoint may still be adding files while the tree is
            # removed (rmtree then finds a folder not empty): remove until it is gone, as a user would.
            for _ in range(200):
                shutil.rmtree(run, ignore_errors=True)
                if not run.exists():
                    break
                time.sleep(0.05)
            assert not run.exists(), f"{run} could not be removed"
            if how == "file":
                run.write_text("not a model_dir")
        return real(self, *args, **kwargs)

    return run_train_loop


@pytest.mark.cli
@pytest.mark.parametrize(
    "how, said",
    [("removed", "was removed during the run"), ("file", "was replaced by a regular file during the run")],
)
def test_a_model_dir_removed_or_replaced_mid_run_is_one_line(copy, monkeypatch, how, said):
    run = copy / "run"
    monkeypatch.setattr(TrainRunner, "_call", _model_dir_lost(run, how))
    flags = [*FLAGS, f"--data_dir={copy / 'data'}", "--train_steps=8", "--checkpoint_every=2"]

    line = one_error_line(main_in_process(*flags, f"--model_dir={run}"))

    assert f"{run} {said}" in line, line
    if how == "file":
        assert run.read_text() == "not a model_dir"  # Left as it is.
    else:  # TensorFlow's writes make it again (ckpt-4's, if still under way): nothing saved after that.
        assert not list(run.glob("checkpoints/ckpt-[68]*")), line


@pytest.mark.cli
def test_a_model_dir_made_unwritable_mid_run_is_one_line_and_the_latest_checkpoint_stays(copy, monkeypatch):
    """Injected: as root (the suite's machines) permissions do not stop a write; the error is
    TensorFlow's for a directory made read-only (the real one: tests/cli/test_model_dir_cli.py)."""
    save = tf.train.CheckpointManager.save

    def denied(self, checkpoint_number=None, **kwargs):
        if checkpoint_number == 6:
            raise tf.errors.PermissionDeniedError(None, None, f"{self.directory}/ckpt-6_temp; Permission denied")
        return save(self, checkpoint_number=checkpoint_number, **kwargs)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", denied)
    run = copy / "run"
    flags = [*FLAGS, f"--data_dir={copy / 'data'}", "--train_steps=8", "--checkpoint_every=2"]

    line = one_error_line(main_in_process(*flags, f"--model_dir={run}"))

    latest = run / "checkpoints" / "ckpt-4"
    assert f"checkpoint at step 6 not saved: {run} is not writable anymore" in line, line
    assert f"the latest checkpoint ({latest}) is kept" in line, line
    assert tf.train.latest_checkpoint(str(run / "checkpoints")) == str(latest)
    assert not list((run / "checkpoints").glob("*_temp"))
