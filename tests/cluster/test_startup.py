"""--startup_timeout: a cluster task whose peers never come exits on its own with
one line naming them, and SIGTERM ends it at any moment of that wait (TF's
connect holds the GIL and installs a SIGTERM handler of its own). Real
processes, each with a timeout."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
from helpers import REPO, python_env

FLAGS = ["--strategy=multi_worker_mirrored", "--model=mlp", "--dataset=synthetic", "--train_steps=4"]
STARTUP_TIMEOUT = 3  # seconds: the wait the test sits through, as short as the bounds below allow


def lone_worker(index: int, *flags: str, model_dir: Path) -> tuple[subprocess.Popen, str]:
    """Task `index` of a 2-worker cluster whose other worker never starts."""
    with socket.socket() as first, socket.socket() as second:
        first.bind(("localhost", 0))
        second.bind(("localhost", 0))
        addresses = [f"localhost:{s.getsockname()[1]}" for s in (first, second)]
    tf_config = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.main", *FLAGS, *flags, f"--model_dir={model_dir}"],
        cwd=REPO,
        env=python_env(TF_CONFIG=tf_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, addresses[1 - index]


def read_until(process: subprocess.Popen, text: str, timeout: float) -> list[str]:
    return helpers.read_until(process.stdout, text, timeout, process).splitlines()


@pytest.fixture
def reaped():
    processes: list[subprocess.Popen] = []
    yield processes.append
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", [0, 1])  # 0 leads the coordination service; 1 waits for it
def test_a_lone_worker_exits_after_startup_timeout_naming_its_peer(tmp_path, reaped, index):
    process, peer = lone_worker(index, f"--startup_timeout={STARTUP_TIMEOUT}", model_dir=tmp_path)
    reaped(process)
    read_until(process, "connecting to", timeout=240)
    began = time.monotonic()
    output, _ = process.communicate(timeout=60)
    waited = time.monotonic() - began
    assert process.returncode != 0
    # The timeout (less 1 s of slack in reading its line), a short grace, and a loaded machine.
    assert STARTUP_TIMEOUT - 1 <= waited <= STARTUP_TIMEOUT + 15, waited
    errors = [line for line in output.splitlines() if "error:" in line and "startup_timeout" in line]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(
        f"engine.main: error: worker:{index} could not reach its peers within "
        f"--startup_timeout={STARTUP_TIMEOUT}s; waited for worker:{1 - index} ({peer})"
    ), errors
    # Nothing written but the task's diagnostics: where its threads waited when the time ran out.
    report = tmp_path / "diagnostics" / f"worker-{index}.txt"
    assert errors[0].endswith(f"; diagnostics in {report}"), errors
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [report]
    text = report.read_text()
    assert text.startswith(f"engine diagnostics of worker-{index}, pid {process.pid}, "), text[:500]
    assert "phase: start-up" in text and "could not reach its peers" in text, text[:2000]
    assert "multi_host.py" in text and "build_multi_host_strategy" in text, text[
        -3000:
    ]  # The main thread's stack.


@pytest.mark.timeout(400)
def test_sigterm_ends_a_worker_waiting_for_its_peers_at_once(tmp_path, reaped):
    process, _ = lone_worker(0, model_dir=tmp_path)  # the default timeout: minutes
    reaped(process)
    read_until(process, "connecting to", timeout=240)
    time.sleep(3)  # inside TF's connect by now
    process.send_signal(signal.SIGTERM)
    began = time.monotonic()
    output, _ = process.communicate(timeout=30)
    assert time.monotonic() - began < 5, output[-2000:]
    assert process.returncode != 0
    assert "SIGTERM during the start-up of worker:0" in output, output[-2000:]
    assert not any(tmp_path.iterdir())
