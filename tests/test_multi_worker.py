"""Real clusters on localhost through `engine.launch`: one process a task, free
ports, each test with a timeout, and a check that no process and no port
survives the run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model=mlp", "--dataset=synthetic", "--optimizer=sgd", "--learning_rate=0.1",
         "--global_batch_size=32", "--eval_every=0"]


class Launched:
    """`python -m engine.launch ...` in its own process group, output collected live."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.launch", *args], cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", **(env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def output_without_grpc_noise(self) -> str:
        """The output less TF's per-call gRPC complaints about a dead peer,
        which otherwise bury the line that says what went wrong."""
        noise = ("Failed to remove function remotely", "Additional GRPC error information",
                 "Error received from peer", "This could happen if the remote target")
        return "\n".join(line for line in self.lines if not any(n in line for n in noise))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matches {pattern!r}:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}") from None
        self._reader.join(timeout=10)
        return code

    def ports(self) -> list[int]:
        match = self.wait_for(r"gRPC port\(s\) ([\d, ]+) accept", timeout=1)
        return [int(port) for port in match.group(1).split(",")]

    def kill_all(self) -> None:
        """Cleanup: the whole process group, whatever state the test left it in."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def assert_nothing_left(self) -> None:
        """No process of the run survives, and no port accepts connections."""
        deadline = time.monotonic() + 15
        while True:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"processes of the run survive:\n{self.output[-3000:]}"
            time.sleep(0.2)
        for port in self.ports():
            with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
                sock.connect(("localhost", port))


@pytest.fixture
def launch():
    started: list[Launched] = []

    def start(*args: str, **kwargs) -> Launched:
        started.append(Launched(*args, **kwargs))
        return started[-1]

    yield start
    for launched in started:
        launched.kill_all()


def run_single_process(*flags: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.main", *flags], cwd=REPO, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2"), timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def model_weights(model_dir: Path, step: int) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{step}"))
    # The model's weights are saved once, under the optimizer that tracks them too.
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("optimizer/_trainable_variables/", "global_step/"))}


@pytest.mark.timeout(180)
def test_two_mirrored_workers_equal_one_process_and_resume(tmp_path, launch):
    flags = [*SMALL, "--steps_per_loop=4"]
    first = launch("--num_workers=2", "--", "--strategy=multi_worker_mirrored", *flags, "--train_steps=12", f"--model_dir={tmp_path / 'mw'}")
    assert first.wait(timeout=120) == 0, first.output[-4000:]
    first.assert_nothing_left()
    digests = re.findall(r"\[worker:(\d)\].*done: step 12.*weights_digest=(\w+)", first.output)
    assert sorted(digests)[0][0] == "0" and len(digests) == 2 and digests[0][1] == digests[1][1], digests

    run_single_process("--strategy=default", *flags, "--train_steps=12", f"--model_dir={tmp_path / 'one'}")
    multi, single = model_weights(tmp_path / "mw", 12), model_weights(tmp_path / "one", 12)
    assert multi.keys() == single.keys() and multi
    for name in multi:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
    metrics = json.loads((tmp_path / "mw" / "metrics.json").read_text())
    assert metrics["global_step"] == 12 and metrics["eval"]["num_examples"] == 256
    assert not (tmp_path / "mw" / ".workertemp").exists()

    second = launch("--num_workers=2", "--", "--strategy=multi_worker_mirrored", *flags, "--train_steps=16", f"--model_dir={tmp_path / 'mw'}")
    assert second.wait(timeout=120) == 0, second.output[-4000:]
    for worker in (0, 1):  # Both restore the chief's checkpoint, so they stay in step.
        second.wait_for(rf"\[worker:{worker}\].*steps=12->16", timeout=1)
        second.wait_for(rf"\[worker:{worker}\].*done: step 16", timeout=1)
    assert (tmp_path / "mw" / "checkpoints" / "ckpt-16.index").exists()
    second.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_dead_mirrored_worker_fails_the_run_and_stops_the_rest(tmp_path, launch):
    run = launch("--num_workers=2", "--", "--strategy=multi_worker_mirrored", *SMALL,
                 "--train_steps=100000", "--steps_per_loop=10", f"--model_dir={tmp_path}")
    run.wait_for(r"\[worker:0\].*step 10/", timeout=90)
    pid = int(run.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=60) == 128 + signal.SIGKILL, run.output[-3000:]
    assert "worker:1 failed with exit status -9; stopping the other tasks" in run.output
    run.assert_nothing_left()


@pytest.mark.timeout(180)
def test_parameter_server_cluster_trains_to_the_step_and_lowers_the_loss(tmp_path, launch):
    run = launch("--num_workers=2", "--num_ps=1", "--", "--strategy=parameter_server", "--model=mlp",
                 "--dataset=digits", "--optimizer=sgd", "--learning_rate=0.1", "--global_batch_size=32",
                 "--train_steps=60", "--steps_per_loop=20", "--eval_every=0", f"--model_dir={tmp_path}")
    assert run.wait(timeout=150) == 0, run.output[-4000:]
    run.assert_nothing_left()
    losses = [float(loss) for loss in re.findall(r"\[chief:0\].*step \d+/60 +loss=([\d.]+)", run.output)]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.7, losses
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 60 and metrics["eval"]["num_examples"] == 297
    assert metrics["eval"]["accuracy"] > 0.5
    assert (tmp_path / "checkpoints" / "ckpt-60.index").exists()
    assert "TensorFlow gRPC port(s)" in run.output


@pytest.mark.timeout(180)
def test_parameter_server_survives_a_killed_worker(tmp_path, launch):
    run = launch("--num_workers=2", "--num_ps=1", "--", "--strategy=parameter_server", *SMALL,
                 "--train_steps=400", "--steps_per_loop=20", f"--model_dir={tmp_path}")
    run.wait_for(r"\[chief:0\].*step 20/400", timeout=120)
    pid = int(run.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=150) == 0, run.output_without_grpc_noise[-6000:]
    assert "worker:1 exited with status -9; restarting it" in run.output
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 400
    assert (tmp_path / "checkpoints" / "ckpt-400.index").exists()
    run.assert_nothing_left()


@pytest.mark.timeout(60)
def test_ctrl_c_ends_every_task(tmp_path, launch):
    run = launch("--num_workers=1", "--num_ps=1", "--", "--strategy=parameter_server", *SMALL,
                 "--train_steps=100000", f"--model_dir={tmp_path}")
    run.wait_for(r"\[ps:0\].*serving at", timeout=40)
    run.process.send_signal(signal.SIGINT)  # The launcher alone, unlike a terminal's Ctrl-C.
    assert run.wait(timeout=30) == 130, run.output[-3000:]
    run.assert_nothing_left()


@pytest.mark.timeout(60)
def test_server_without_a_cluster_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "engine.server", "--task_type=chief"], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                            timeout=50)
    assert result.returncode == 2
    assert "engine.server: error: --task_type=chief / --task_index=None given without a cluster" in result.stderr
