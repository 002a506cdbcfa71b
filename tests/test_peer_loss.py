"""A peer that stops answering mid-run: TF's errors become one line naming it (fast), and a
frozen worker of a real two-worker cluster ends its peer's run within the heartbeat bound."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import REPO, SMALL, free_ports, python_env, signal_group

from engine.cluster import resolve_cluster
from engine.cluster.peer_loss import peer_lost_message
from engine.errors import PEER_LOST_EXIT

# TF 2.21's words for a worker frozen by SIGSTOP (seen on worker:0, its peer worker:1).
UNHEALTHY = (
    "Graph execution error:\n\nDetected at node while/sgd/CollectiveReduceV2 defined at "
    "(most recent call last):\n"
    '  File "engine/loop.py", line 95, in run_step\n'
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
    "The tasks have crashed. Check the task logs for an earlier error.\n"
    "\t [[{{node while/sgd/CollectiveReduceV2}}]] [Op:__inference_train_loop_882]"
)


def _worker0():
    return resolve_cluster(worker_hosts=["localhost:1111", "localhost:2222"], task_type="worker", task_index=0)


def test_unhealthy_tasks_become_one_line_naming_the_frozen_peer():
    error = tf.errors.UnavailableError(None, None, UNHEALTHY)
    kept = "the latest checkpoint (x) is kept"
    message = peer_lost_message(error, _worker0(), heartbeat_timeout=10, kept=kept)
    assert message is not None and "\n" not in message
    assert message.startswith("worker:0: worker:1 (localhost:2222) stopped answering (no heartbeat for 10 s)")
    assert "the latest checkpoint (x) is kept" in message and "--max_restarts" in message


def test_a_dropped_connection_names_every_peer_and_other_errors_are_left_alone():
    closed = tf.errors.UnavailableError(None, None, "Socket closed\nAdditional GRPC error information")
    message = peer_lost_message(closed, _worker0(), heartbeat_timeout=10, kept="kept")
    assert message is not None and "worker:1 (localhost:2222) stopped answering (Socket closed)" in message
    unrelated = tf.errors.InternalError(None, None, "Blas GEMM launch failed")
    assert peer_lost_message(unrelated, _worker0(), heartbeat_timeout=10, kept="kept") is None
    assert peer_lost_message(closed, None, heartbeat_timeout=10, kept="kept") is None  # No cluster, no peer.


def _start(flags: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "engine.main", *flags],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=output,
            env=python_env(),
            start_new_session=True,
        )


def _end(process: subprocess.Popen) -> None:
    """SIGCONT (a stopped process ignores SIGKILL until continued on some kernels) and SIGKILL."""
    for signum in (signal.SIGCONT, signal.SIGKILL):
        signal_group(process, signum)
    process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_frozen_worker_ends_its_peers_run_with_one_line_within_the_heartbeat_bound(tmp_path):
    heartbeat_timeout = 12  # Not TF's 10: the flag sets the bound (and 12 s keeps the suite short).
    ports = free_ports(2)
    common = [
        "--strategy=multi_worker_mirrored",
        *SMALL,
        "--train_steps=100000",
        "--steps_per_loop=10",
        f"--heartbeat_timeout={heartbeat_timeout}",
        f"--worker_hosts={','.join(f'localhost:{port}' for port in ports)}",
        "--task_type=worker",
        f"--model_dir={tmp_path / 'run'}",
    ]
    logs = [tmp_path / "worker0.err", tmp_path / "worker1.err"]
    survivor = _start([*common, "--task_index=0"], logs[0])
    frozen = _start([*common, "--task_index=1"], logs[1])
    try:
        deadline = time.monotonic() + 400
        while not re.search(r"step 10/", logs[0].read_text()):  # Both train in lockstep.
            assert survivor.poll() is None and frozen.poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        signal_group(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        margin = 30  # The check's own period and a loaded machine.
        try:
            code = survivor.wait(timeout=heartbeat_timeout + margin)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker:0 still runs: {logs[0].read_text()[-3000:]}") from None
        took = time.monotonic() - stopped
    finally:
        _end(frozen)
        _end(survivor)
    print(f"worker:0 exited {code} {took:.1f} s after SIGSTOP to worker:1, heartbeat={heartbeat_timeout}")
    err = logs[0].read_text()
    assert code == PEER_LOST_EXIT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("engine.main: error:")]
    assert len(ours) == 1 and err.rstrip().endswith(ours[0]), err[-3000:]
    lost = f"worker:1 (localhost:{ports[1]}) stopped answering (no heartbeat for {heartbeat_timeout} s)"
    assert lost in ours[0], ours[0]
    assert heartbeat_timeout / 2 - 2 <= took <= heartbeat_timeout + margin, took


class _Process:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_the_launchers_restart_line_names_the_peer_that_stopped_answering():
    from engine.cli.task_processes import Task, cause_of

    hosts = ["localhost:1111", "localhost:2222"]
    workers = [
        Task(resolve_cluster(worker_hosts=hosts, task_type="worker", task_index=i), [], _Process(code))
        for i, code in ((0, PEER_LOST_EXIT), (1, None))
    ]
    restart = cause_of(workers[0], PEER_LOST_EXIT, workers)
    assert restart == "worker:1 stopped answering (worker:0 exited with status 69)"
    assert cause_of(workers[0], 1, workers) == "worker:0 exited with status 1"
