"""`engine.launch --data_workers=N` and `python -m engine.data_service`: the launcher starts a
tf.data service beside its tasks, the run trains the weights of local input with one data
worker and says where its input comes from, nothing is left running; a data worker killed
mid-run while another serves is said and survived, the last one ends the run in one line with
exit 69, its latest checkpoint kept; a data worker whose
dispatcher is not there exits 69 in one line within its bound. Real processes on localhost.

Covers: engine/launch/data_processes.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO, SMALL, free_ports, latest_step, model_weights, python_env

FLAGS = [
    "--strategy=multi_worker_mirrored",
    *SMALL,
    "--deterministic",
    "--steps_per_loop=4",
    "--device_data_mb=0",  # Both runs stream their batches through tf.data.
    "--mode=train",
]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _service_pids(run) -> list[int]:
    return [int(pid) for pid in re.findall(r"started (?:dispatcher|data_worker:\d+) \(pid (\d+)\)", run.output)]


@pytest.mark.timeout(400)
def test_one_data_worker_trains_the_weights_of_local_input(tmp_path, launch):
    steps = ["--train_steps=12"]
    served = launch("--num_workers=1", "--data_workers=1", "--", *FLAGS, *steps, f"--model_dir={tmp_path / 's'}")
    assert served.wait(timeout=300) == 0, served.output[-5000:]
    local = launch("--num_workers=1", "--", *FLAGS, *steps, f"--model_dir={tmp_path / 'local'}")
    assert local.wait(timeout=300) == 0, local.output[-5000:]
    address = served.wait_for(r"tf\.data service at (grpc://localhost:\d+), 1 data worker", timeout=1).group(1)
    assert re.search(rf"\[worker:0\].*tf\.data service at {address} \(parallel_epochs\)", served.output)
    assert "tf.data service" not in local.output
    expected, got = model_weights(tmp_path / "local", 12), model_weights(tmp_path / "s", 12)
    assert expected.keys() == got.keys() and got
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    pids = _service_pids(served)
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), pids  # The dispatcher and the worker.
    served.assert_nothing_left()


@pytest.mark.timeout(400)
def test_a_killed_data_worker_is_survived_and_the_last_one_ends_the_run_with_69_keeping_the_checkpoint(
    tmp_path, launch
):
    run = launch(
        "--num_workers=1",
        "--data_workers=2",
        "--",
        *FLAGS,
        "--train_steps=100000",
        "--checkpoint_every=8",
        f"--model_dir={tmp_path}",
    )
    run.wait_for(r"\[worker:0\].*Saved checkpoint", timeout=240)
    pids = [int(run.wait_for(rf"started data_worker:{i} \(pid (\d+)\)", timeout=1).group(1)) for i in (0, 1)]
    last, first = pids
    os.kill(first, signal.SIGKILL)
    warning = (
        f"[launch] warning: data_worker:1 (pid {first}) of the tf.data service exited with signal 9; the "
        "run goes on with the 1 data worker(s) left"
    )
    run.wait_for(re.escape(warning), timeout=30)
    survived = latest_step(tmp_path)
    deadline = time.monotonic() + 120
    while latest_step(tmp_path) == survived:  # Training goes on, reading from the worker left.
        assert time.monotonic() < deadline and run.process.poll() is None, run.output[-4000:]
        time.sleep(0.2)
    os.kill(last, signal.SIGKILL)
    assert run.wait(timeout=120) == 69, run.output[-5000:]
    line = (
        f"[launch] data_worker:0 (pid {last}) of the tf.data service exited with signal 9; the training input "
        "is gone (no data worker left); stopping the training tasks (the latest checkpoint is kept), exit 69"
    )
    assert line in run.lines, run.output[-5000:]
    step = latest_step(tmp_path)
    assert step is not None and step > survived and model_weights(tmp_path, step)
    assert all(_gone(p) for p in _service_pids(run))
    run.assert_nothing_left()


def test_a_data_worker_without_its_dispatcher_exits_69_in_one_line():
    (port,) = free_ports(1)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "engine.data_service", "--worker", f"--dispatcher_address=localhost:{port}"]
        + ["--startup_timeout=1"],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 69, result.stderr
    assert result.stderr.startswith(
        f"engine.data_service: error: cannot reach the tf.data service dispatcher at localhost:{port} within 1 s"
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    "args, line",
    [
        (["--dispatcher", "--port=nan"], "engine.data_service: error: flag --port=nan: invalid literal"),
        (["--dispatcher", "--worker"], "engine.data_service: error: pass exactly one of --dispatcher, --worker"),
        (["--worker"], "engine.data_service: error: --worker needs --dispatcher_address=HOST:PORT"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, line):
    result = subprocess.run(
        [sys.executable, "-m", "engine.data_service", *args],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.startswith(line), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
