"""An interrupted test suite leaves no process behind (tests/started_processes.py): a tiny
pytest session, run with this suite's conftest, starts a process group that would live for
minutes, and SIGTERM (`timeout`'s, a scheduler's) or SIGINT (Ctrl-C) to that pytest alone
ends it within seconds, with and without pytest-xdist's workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, python_env, signal_group

TESTS = REPO / "tests"
ENDED_WITHIN_S = 15.0

# Started as the suite's tests start theirs: a process group of its own, with a child in it.
LONG_LIVED = """
import subprocess, sys, time

def test_starts_a_group_and_sleeps(tmp_path):
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
        process_group=0,
    )
    with open(PIDFILE + ".tmp", "w") as pidfile:
        pidfile.write(str(leader.pid))
    __import__("os").rename(PIDFILE + ".tmp", PIDFILE)
    time.sleep(600)
"""


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (a zombie waiting for its parent does not)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # After the command's name.
        except OSError:
            continue  # Gone meanwhile.
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "workers,signum",
    [("0", signal.SIGTERM), ("1", signal.SIGTERM), ("0", signal.SIGINT)],
    ids=["SIGTERM", "SIGTERM-xdist", "SIGINT"],
)
def test_a_signal_to_pytest_ends_the_process_groups_its_tests_started(tmp_path: Path, workers, signum):
    pidfile = tmp_path / "group.pid"
    test_file = tmp_path / "test_long_lived.py"
    test_file.write_text(f"PIDFILE = {str(pidfile)!r}\n" + LONG_LIVED)
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-n", workers, "-p", "no:cacheprovider"]
        + ["-c", os.devnull, "--rootdir", str(tmp_path), "-q", str(test_file)],
        cwd=tmp_path,
        env=python_env(PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    pgid = None
    try:
        deadline = time.monotonic() + 180
        while not pidfile.exists():
            assert pytest_run.poll() is None, pytest_run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the tiny session's test never started its group"
            time.sleep(0.1)
        pgid = int(pidfile.read_text())
        time.sleep(0.5)  # The test is in its sleep.
        assert _group_alive(pgid)
        pytest_run.send_signal(signum)  # To pytest alone: not its group, not its test's.
        sent = time.monotonic()
        while _group_alive(pgid) and time.monotonic() - sent < ENDED_WITHIN_S:
            time.sleep(0.1)
        assert not _group_alive(pgid), f"the test's process group outlived pytest's {signum.name}"
        output, _ = pytest_run.communicate(timeout=60)
    finally:
        signal_group(pytest_run)
        pytest_run.wait(timeout=30)
        if pgid is not None and _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    assert pytest_run.returncode != 0, output[-3000:]  # Interrupted, not passed.
