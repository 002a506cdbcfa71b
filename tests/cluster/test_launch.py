"""engine.launch as a supervisor: whole-cluster restarts under --max_restarts,
an evaluator task beside training, and its exit statuses. Real processes on
localhost, each test with a timeout; the `launch` fixture reaps them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO, SMALL, eval_steps, latest_step, model_weights

MWM = ["--strategy=multi_worker_mirrored", *SMALL, "--deterministic", "--steps_per_loop=4"]


@pytest.mark.timeout(700)
def test_a_killed_worker_restarts_the_cluster_and_ends_with_the_uninterrupted_weights(tmp_path, launch):
    # 160 steps: the kill at step 40-49 still lands with some 110 steps to go (a second's training
    # at full speed; the test waits 0.1 s a poll), and the two clusters train 280 fewer steps than at 300.
    flags = [*MWM, "--train_steps=160", "--checkpoint_every=20"]
    plain = launch("--num_workers=2", "--", *flags, f"--model_dir={tmp_path / 'plain'}")  # beside the other
    run = launch("--num_workers=2", "--max_restarts=2", "--", *flags, f"--model_dir={tmp_path / 'restarted'}")
    run.wait_for(r"\[worker:0\].*step 4\d/160", timeout=240)
    pid = int(run.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=300) == 0, run.output[-5000:]
    assert plain.wait(timeout=240) == 0, plain.output[-4000:]
    restarts = [line for line in run.lines if "restarting the cluster" in line]
    assert restarts == ["[launch] restarting the cluster (1/2): worker:1 exited with signal 9"], restarts
    assert re.search(r"\[worker:0\].*steps=([1-9]\d*)->160", run.output), run.output[-3000:]  # resumed
    addresses = re.findall(r"started worker:0 \(pid \d+\) at (\S+):", run.output)
    assert len(addresses) == 2 and addresses[0] != addresses[1], addresses  # fresh ports
    restarted, uninterrupted = model_weights(tmp_path / "restarted", 160), model_weights(tmp_path / "plain", 160)
    assert restarted.keys() == uninterrupted.keys() and restarted
    for name in restarted:
        np.testing.assert_array_equal(restarted[name], uninterrupted[name], err_msg=name)
    # The time the restart lost is in the chief's goodput; the uninterrupted run lost none.
    goodput = json.loads((tmp_path / "restarted" / "metrics.json").read_text())["goodput"]
    assert goodput["restarts"] == 1 and 0 < goodput["restarts_lost_s"] < 600, goodput
    assert "restarts" not in json.loads((tmp_path / "plain" / "metrics.json").read_text())["goodput"]
    run.assert_nothing_left()


@pytest.mark.timeout(500)
def test_an_evaluator_task_evaluates_beside_a_launched_cluster(tmp_path, launch):
    # --mode=train: the workers do not evaluate, so every eval summary is the evaluator's.
    run = launch(
        "--num_workers=2",
        "--evaluator",
        "--",
        *MWM,
        "--train_steps=200",
        "--checkpoint_every=50",
        "--mode=train",
        "--eval_timeout=120",
        f"--model_dir={tmp_path}",
    )
    assert run.wait(timeout=400) == 0, run.output[-5000:]
    assert re.search(r"started evaluator:0 .*engine.main", run.output)
    assert re.search(r"\[evaluator:0\].*eval at step 200", run.output), run.output[-3000:]
    assert "[launch] evaluator:0 finished with exit status 0" in run.output
    assert not re.search(r"\[evaluator:0\].*step \d+/200", run.output)  # it never trains
    steps = eval_steps(tmp_path)
    assert steps[-1] == 200 and len(steps) == len(set(steps)), steps
    metrics = json.loads((tmp_path / "metrics.json").read_text())  # the chief's, with the evaluator's eval
    assert metrics["global_step"] == 200 and metrics["eval"]["num_examples"] == 256, metrics
    run.assert_nothing_left()


# Holds a model_dir's writer lock as a running engine.main does (engine.model_dir.writer_lock).
_HOLD_LOCK = """
import fcntl, json, os, socket, sys, time
fd = os.open(os.path.join(sys.argv[1], ".writer.lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "then"}).encode(), 0)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(400)
def test_a_second_launcher_on_a_model_dir_in_use_is_one_line_naming_its_holder(tmp_path, launch):
    """worker:0 is refused in one line naming the lock's holder; worker:1, left in the broadcast
    of its first variable, died with a 45-line UnavailableError traceback. Nothing is written."""
    command = [sys.executable, "-c", _HOLD_LOCK, str(tmp_path)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        record = (tmp_path / ".writer.lock").read_bytes()
        run = launch("--num_workers=2", "--", *MWM, "--train_steps=20", f"--model_dir={tmp_path}")
        assert run.wait(timeout=300) == 2, run.output[-5000:]
        refused = [line for line in run.lines if "engine.main: error:" in line]
        in_use = f"[worker:0] engine.main: error: --model_dir={tmp_path} is in use by pid {holder.pid} on host"
        assert refused[0].startswith(in_use), refused
        # worker:1 ends by the launcher's SIGTERM or, if worker:0's exit reaches it first, in one line too.
        assert all("stopped answering" in line and "before training" in line for line in refused[1:]), refused
        assert "Traceback" not in run.output, run.output[-5000:]
        assert os.listdir(tmp_path) == [".writer.lock"] and (tmp_path / ".writer.lock").read_bytes() == record
        assert holder.poll() is None  # The run in use keeps its lock.
        run.assert_nothing_left()
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.mark.timeout(500)
def test_ctrl_z_and_fg_of_a_launchers_group_in_start_up_and_training_let_the_run_finish(tmp_path, launch):
    """Ctrl-Z then `fg` (SIGTSTP, then SIGCONT, to the launcher's whole process group; a
    scheduler's suspend and resume): its workers' signal watchers took garbage for SIGQUIT or
    SIGHUP and ended them (tests/process/test_job_control.py has engine.main alone)."""
    steps = 300  # past step 100 (the third stop) some 190 steps still train: 1.5 s at full speed
    run = launch("--num_workers=2", "--", *MWM, f"--train_steps={steps}", f"--model_dir={tmp_path}")
    run.wait_for(r"started worker:1", timeout=60)
    time.sleep(1.0)  # The workers import TensorFlow.
    for step in ("start-up", r"step \d+", r"step [1-9]\d\d+"):
        if step != "start-up":
            run.wait_for(rf"\[worker:0\].*{step}/{steps}", timeout=240)
        os.killpg(run.process.pid, signal.SIGTSTP)
        time.sleep(1.0)
        os.killpg(run.process.pid, signal.SIGCONT)
    assert run.wait(timeout=300) == 0, run.output[-4000:]
    assert re.search(rf"\[worker:0\].*done: step {steps},", run.output), run.output[-3000:]
    assert "received" not in run.output and "Traceback" not in run.output, run.output[-3000:]
    run.assert_nothing_left()


@pytest.mark.timeout(500)
def test_ctrl_c_saves_once_a_second_sigterm_ends_at_once_and_a_flag_error_exits_2(tmp_path, launch):
    flags = [*MWM, "--train_steps=100000", "--checkpoint_every=100000", f"--model_dir={tmp_path}"]
    # Ctrl-C in a terminal: SIGINT to the launcher's whole process group. The workers took the
    # launcher's SIGTERM for their second signal and exited without a save, leaving the lock.
    run = launch("--num_workers=2", "--", *flags)
    run.wait_for(r"\[worker:0\].*step \d+/100000", timeout=240)
    sent = time.monotonic()
    os.killpg(run.process.pid, signal.SIGINT)
    assert run.wait(timeout=120) == 130, run.output[-3000:]
    took = time.monotonic() - sent
    stopped = [
        int(run.wait_for(rf"\[worker:{i}\].*stopped at step (\d+) by signal 2;", 1).group(1)) for i in (0, 1)
    ]
    assert stopped[0] == stopped[1] == latest_step(tmp_path) and stopped[0] > 0, stopped  # one agreed save
    assert not list(tmp_path.rglob("*_temp")) and not (tmp_path / ".writer.lock").exists()
    assert "Traceback" not in run.output and took < 60, took
    run.assert_nothing_left()

    # A second SIGTERM while the tasks save: every task ends at once, one line, no traceback.
    again = launch("--num_workers=2", "--", *flags)
    again.wait_for(rf"\[worker:0\].*steps={stopped[0]}->", timeout=240)  # resumed
    again.wait_for(r"\[worker:0\].*step \d+/100000", timeout=120)
    frozen = int(again.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(frozen, signal.SIGSTOP)  # so that the agreed save waits for it: the second signal lands in it
    again.process.send_signal(signal.SIGTERM)
    again.wait_for(r"\[launch\] SIGTERM received; stopping every task", timeout=10)
    sent = time.monotonic()
    again.process.send_signal(signal.SIGTERM)
    assert again.wait(timeout=60) == 143, again.output[-3000:]
    assert time.monotonic() - sent < 10 and "Traceback" not in again.output, again.output[-3000:]
    assert [line for line in again.lines if "received again" in line] == [
        "[launch] SIGTERM received again: every task ended at once (SIGKILL), without its save; exit 143"
    ]
    again.assert_nothing_left()

    result = subprocess.run(
        [sys.executable, "-m", "engine.launch", "--num_workers=2", "--", "--train_stepz=3"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "engine.launch: error: the flags after -- are not engine.main's" in result.stderr
    assert "train_stepz" in result.stderr and "started" not in result.stderr
