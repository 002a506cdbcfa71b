"""A signal to ONE worker of a multi-worker run stops every worker at the same
step with a checkpoint, and the cluster resumes from it.

Covers: engine/stopping.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import REPO, free_ports, signal_group

FLAGS = [
    "--strategy=multi_worker_mirrored",
    "--model=mlp",
    "--dataset=synthetic",
    "--optimizer=sgd",
    "--global_batch_size=32",
    "--eval_every=0",
    "--steps_per_loop=10",
    "--checkpoint_every=1000000",
    "--collective_timeout=60",
    "--log_all_tasks",  # Both workers' progress lines: the tests wait until both are at a step.
]


class Workers:
    """Worker processes started by hand, each with its TF_CONFIG and a log file."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, *flags: str) -> None:
        ports = free_ports(2)
        cluster = {"worker": [f"localhost:{port}" for port in ports]}
        self.processes, self.logs = [], []
        for index in range(2):
            log = self.tmp_path / f"worker{index}-{time.monotonic_ns()}.log"
            env = dict(
                os.environ,
                PYTHONPATH=str(REPO),
                TF_CPP_MIN_LOG_LEVEL="2",
                TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
            )
            with open(log, "w") as handle:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "engine.main", *FLAGS, *flags],
                        cwd=REPO,
                        env=env,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        process_group=0,
                    )
                )
            self.logs.append(log)

    def log(self, index: int) -> str:
        return self.logs[index].read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(text in self.log(i) for i in range(2)):
            assert time.monotonic() < deadline, f"no {text!r}:\n{self.log(0)[-2000:]}\n{self.log(1)[-2000:]}"
            assert all(p.poll() is None for p in self.processes), self.log(0)[-2000:] + self.log(1)[-2000:]
            time.sleep(0.2)

    def wait(self, timeout: float) -> list[int]:
        return [process.wait(timeout=timeout) for process in self.processes]

    def kill(self) -> None:
        for process in self.processes:
            signal_group(process)
            process.wait(timeout=30)


@pytest.fixture
def workers(tmp_path):
    started = Workers(tmp_path)
    yield started
    started.kill()


@pytest.mark.timeout(600)
def test_sigterm_to_one_worker_stops_all_at_one_step_and_resumes(workers, tmp_path):
    model_dir = tmp_path / "run"
    workers.start("--train_steps=1000000", f"--model_dir={model_dir}")
    workers.wait_for("step 20/", timeout=240)
    workers.processes[1].send_signal(signal.SIGTERM)  # the non-chief worker only
    codes = workers.wait(timeout=150)
    assert codes == [75, 128 + signal.SIGTERM], workers.log(0)[-3000:] + workers.log(1)[-3000:]
    saved = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    step = int(saved.rsplit("-", 1)[1])
    assert step >= 20 and step % 10 == 0
    assert f"stopped at step {step}" in workers.log(0) and f"stopped at step {step}" in workers.log(1)
    assert not (model_dir / ".workertemp").exists() or not any((model_dir / ".workertemp").iterdir())

    workers.start(f"--train_steps={step + 10}", f"--model_dir={model_dir}")
    assert workers.wait(timeout=240) == [0, 0], workers.log(0)[-3000:] + workers.log(1)[-3000:]
    assert f"steps={step}->{step + 10}" in workers.log(0)
    assert json.loads((model_dir / "metrics.json").read_text())["global_step"] == step + 10
