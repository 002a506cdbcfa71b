"""Job control never stops a run: Ctrl-Z then `fg` (SIGSTOP or SIGTSTP, then SIGCONT; a
scheduler's suspend and resume) in start-up and in training, and the run goes on to exit 0.

Python 3.11's `sigtimedwait`, stopped and continued past its deadline, returns a siginfo it
never filled; the signal watcher took it for SIGQUIT or SIGHUP and ended the run (the
watcher's checks: tests/unit/launch/test_launcher_signals.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, popen_main, python_env, read_stderr_until, read_until, stop

STOPPED_SECONDS = 0.6  # Past the old watcher's 0.2 s wait: its deadline passes while stopped.


def stop_and_continue(process: subprocess.Popen, stop_signal: int = signal.SIGSTOP) -> None:
    """What Ctrl-Z then `fg` sends: a stop, a pause, SIGCONT."""
    process.send_signal(stop_signal)
    time.sleep(STOPPED_SECONDS)
    process.send_signal(signal.SIGCONT)


# The watcher alone, loaded by path (no TensorFlow): it waits while the main thread sleeps.
WATCHER_ONLY = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("preemption", "engine/cli/process/preemption.py")
preemption = importlib.util.module_from_spec(spec)
spec.loader.exec_module(preemption)
preemption.install_watcher()
print("watching", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_the_watcher_takes_no_signal_from_a_stop_and_still_takes_a_real_one():
    process = subprocess.Popen(
        [sys.executable, "-c", WATCHER_ONLY],
        cwd=REPO,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        read_until(process.stdout, "watching", timeout=30, process=process)
        for stop_signal in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGSTOP):
            stop_and_continue(process, stop_signal)
            time.sleep(0.3)
        assert process.poll() is None, process.communicate(timeout=10)[1][-3000:]
        process.send_signal(signal.SIGTERM)  # The watcher lives: it takes this one (no run: exit at once).
        _, stderr = process.communicate(timeout=30)
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    received = re.findall(r"\w+ received.*", stderr)  # One line, naming this process as the sender.
    sender = f"(sent by pid {os.getpid()}: {me()})"
    assert received == [f"SIGTERM received: exiting now with status 143 {sender}"], stderr


def me() -> str:
    """This process's command line as the watcher names a sender."""
    with open("/proc/self/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]


@pytest.mark.timeout(300)
def test_ctrl_z_and_fg_in_start_up_and_twice_in_training_let_the_run_finish(tmp_path):
    steps = 6000
    flags = ["--model=mlp", f"--train_steps={steps}", "--steps_per_loop=20", "--eval_every=0"]
    process = popen_main(*flags, "--checkpoint_every=1000000", f"--model_dir={tmp_path}")
    try:
        time.sleep(1.5)  # Importing TensorFlow, the watcher waiting.
        stop_and_continue(process)
        seen = read_stderr_until(process, "step 20/", timeout=240)  # Training is under way.
        stop_and_continue(process, signal.SIGTSTP)
        seen += read_stderr_until(process, f"/{steps}  loss", timeout=60)  # Another loop's line after it.
        stop_and_continue(process)
        stdout, stderr = process.communicate(timeout=240)
    finally:
        stop(process)
    stderr = seen + stderr
    assert process.returncode == 0, stderr[-3000:]
    assert f"done: step {steps}," in stderr + stdout, stderr[-3000:]
    assert "received" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert not (tmp_path / ".writer.lock").exists()
