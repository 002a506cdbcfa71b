"""A watchdog process for a cluster task's start-up, run by path (no TensorFlow, no engine import):

    python engine/cluster/startup_watchdog.py PID SECONDS TIMEOUT_FLAG TASK REPORT STACKS PEER=HOST:PORT ...

TensorFlow connects a task to its peers inside one C++ call that holds the
GIL, so nothing in the task's own process can time it out. This process
waits on its stdin (the task closes it, or dies, when the start-up is
over) for SECONDS (0: no limit); if the task is still starting
then, it prints one line naming the peers that do not answer and kills the
task. The task blocks SIGTERM and SIGINT during its start-up (TensorFlow
would otherwise take SIGTERM with a handler of its own); the watchdog sees
them pending and kills the task at once, as their default action would.

Before it kills a task that timed out, and where REPORT (a file path; "" for none) is given, it
sends SIGUSR2, on which the task's faulthandler writes every thread's Python stack to STACKS
(a C handler: it runs although TensorFlow holds the GIL), and writes REPORT from them: the
task's diagnostics report (as engine.diagnostics writes one), which the error line names.
"""

import contextlib
import datetime
import os
import select
import signal
import socket
import sys
import tempfile
import time

POLL_SECONDS = 0.1
STACKS_SIGNAL = signal.SIGUSR2  # engine.cluster.multi_host.STARTUP_STACKS_SIGNAL
STACKS_WAIT_SECONDS = 2.0  # For faulthandler to finish writing (it takes milliseconds).
MAX_REPORT_BYTES = 256 * 1024  # engine.diagnostics.MAX_BYTES


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    pid, timeout, flag, task, report, stacks = int(argv[1]), float(argv[2]), argv[3], argv[4], argv[5], argv[6]
    peers = [peer.split("=", 1) for peer in argv[7:]]
    deadline = time.monotonic() + timeout if timeout else None
    while deadline is None or time.monotonic() < deadline:
        readable, _, _ = select.select([sys.stdin], [], [], POLL_SECONDS)
        if readable:  # EOF: the start-up finished (or the task is gone).
            return 0
        signum = pending_stop_signal(pid)
        if signum:
            print(
                f"engine.main: {signal.Signals(signum).name} during the start-up of {task}; "
                "ending it (nothing was written)",
                file=sys.stderr,
                flush=True,
            )
            kill(pid)
            with contextlib.suppress(OSError):
                if stacks:
                    os.unlink(stacks)  # No report: the task ends as its signal asked.
            return 0
    silent = [(name, address) for name, address in peers if not answers(address)] or peers
    message = (
        f"engine.main: error: {task} could not reach its peers within --startup_timeout={flag}s; "
        f"waited for {', '.join(f'{name} ({address})' for name, address in silent)}; start every task "
        "of the cluster, check their addresses, or raise --startup_timeout"
    )
    if report and stacks and write_report(pid, task, report, stacks, ended=message):
        message += f"; diagnostics in {report}"
    print(message, file=sys.stderr, flush=True)
    kill(pid)
    return 0


def write_report(pid: int, task: str, report: str, stacks: str, *, ended: str) -> bool:
    """Has the task write its threads' stacks to `stacks` and writes its report to `report`
    (atomically; a symbolic-link folder refused, as engine.diagnostics does); whether it did."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, STACKS_SIGNAL)
    deadline, size = time.monotonic() + STACKS_WAIT_SECONDS, -1
    while time.monotonic() < deadline:  # Until the dump stops growing.
        time.sleep(POLL_SECONDS)
        with contextlib.suppress(OSError):
            if 0 < size == os.path.getsize(stacks):
                break
            size = os.path.getsize(stacks)
    try:
        with open(stacks, errors="replace") as handle:
            dumped = handle.read(MAX_REPORT_BYTES)
        os.unlink(stacks)
        directory = os.path.dirname(report)
        if os.path.islink(directory):
            return False
        os.makedirs(directory, exist_ok=True)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        name = task.replace(":", "-")
        header = f"engine diagnostics of {name}, pid {pid}, {now}\nphase: start-up\nended: {ended}\n\n"
        # Created exclusively under a name nobody can guess, never through a link (as
        # engine.model_dir.write_atomically does): a predictable name in a model_dir from
        # someone else could be a link to a file of the user's.
        fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(report)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write((header + dumped)[:MAX_REPORT_BYTES])
            os.replace(partial, report)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        return True
    except OSError:
        return False


def pending_stop_signal(pid: int) -> int | None:
    """SIGTERM, SIGINT or SIGHUP if the task has one pending (blocked), from /proc/PID/status."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
    except OSError:
        return None
    pending = int(fields.get("ShdPnd", "0").strip(), 16) | int(fields.get("SigPnd", "0").strip(), 16)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if pending & (1 << (signum - 1)):
            return signum
    return None


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
