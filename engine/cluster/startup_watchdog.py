"""A watchdog process for a cluster task's start-up, run by path (no TensorFlow, no engine import):

    python engine/cluster/startup_watchdog.py PID SECONDS TIMEOUT_FLAG TASK PEER=HOST:PORT ...

TensorFlow connects a task to its peers inside one C++ call that holds the
GIL, so nothing in the task's own process can time it out. This process
waits on its stdin (the task closes it, or dies, when the start-up is
over) for SECONDS (0: no limit); if the task is still starting
then, it prints one line naming the peers that do not answer and kills the
task. The task blocks SIGTERM and SIGINT during its start-up (TensorFlow
would otherwise take SIGTERM with a handler of its own); the watchdog sees
them pending and kills the task at once, as their default action would.
"""

import contextlib
import os
import select
import signal
import socket
import sys
import time

POLL_SECONDS = 0.1


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    pid, timeout, flag, task = int(argv[1]), float(argv[2]), argv[3], argv[4]
    peers = [peer.split("=", 1) for peer in argv[5:]]
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
            return 0
    silent = [(name, address) for name, address in peers if not answers(address)] or peers
    print(
        f"engine.main: error: {task} could not reach its peers within --startup_timeout={flag}s; "
        f"waited for {', '.join(f'{name} ({address})' for name, address in silent)}; start every task "
        "of the cluster, check their addresses, or raise --startup_timeout",
        file=sys.stderr,
        flush=True,
    )
    kill(pid)
    return 0


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
