"""Every process a test session starts is ended with it: when it ends, and when it is
interrupted (SIGTERM from `timeout` or a scheduler, SIGINT from Ctrl-C).

Tests start `engine.main`, `engine.launch` clusters and servers in process groups of their
own (`process_group=0`, see `signal_group`), which neither a terminal's Ctrl-C nor `timeout`'s
signal to pytest's group reaches; a test's own cleanup (its fixture, its `finally`) does not
run when pytest dies of SIGTERM, and an interrupted suite left clusters training (one to
100,000 steps). So `install` (tests/conftest.py, in pytest-xdist's controller and in each
worker) records every `subprocess.Popen` of the process, and ends them all:

- a process started in a group of its own: SIGKILL to that group (all it started);
- a process left in pytest's group (a pytest-xdist worker, for its controller): SIGTERM, on
  which a worker ends its own tests' groups in turn.

No heavy import here: pytest-xdist's controller imports this module and no TensorFlow.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from types import FrameType
from typing import Any

ENDED_ON = (signal.SIGTERM, signal.SIGINT)

_started: list[tuple[subprocess.Popen, bool]] = []  # Each process, and whether it leads a group of its own.
_started_lock = threading.RLock()  # Reentrant: a signal handler may run while its thread holds it.
_previous_handlers: dict[int, Any] = {}
_original_init = subprocess.Popen.__init__


def signal_group(process: subprocess.Popen, signum: int = signal.SIGKILL) -> None:
    """`signum` to the process group `process` leads (started with
    process_group=0), and never to a stranger's group.

    A group of its own, not a session (start_new_session): with Linux's
    autogroup scheduling (on here and on CI) every session is a scheduling
    group that gets as much CPU as all of pytest's session, so a test's
    processes in new sessions starved the other xdist worker's in-process
    tests (a 2-second test seen taking 41 s, with 1 CPU-second).

    Once the leader is reaped and its group is empty, its pid is free: with
    pid_max at 32768 and TensorFlow's threads drawing from the same counter,
    the suite wraps it, and a later test's group leader may get the pid
    (one such kill ended another test's training before its first line). A
    reaped leader whose pid is alive again is that stranger: left alone. A
    group whose reaped leader left children keeps its id reserved, so they
    are still ours to end."""
    if process.returncode is not None and _pid_exists(process.pid):
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def group_exists(process: subprocess.Popen) -> bool:
    """Whether any process of the group `process` led still runs (see `signal_group`)."""
    if process.returncode is not None and _pid_exists(process.pid):
        return False  # a stranger's group, since ours was reaped
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recording_init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    """`subprocess.Popen.__init__`, and the process recorded (a failed start records nothing)."""
    _original_init(self, *args, **kwargs)
    own = kwargs.get("process_group") == 0 or bool(kwargs.get("start_new_session"))
    with _started_lock:
        # Ended ones are reaped (as subprocess reaps those it drops) and forgotten, but for a
        # group whose leader left children in it.
        _started[:] = [(p, group) for p, group in _started if _may_run(p, group)]
        _started.append((self, own))


def _may_run(process: subprocess.Popen, own_group: bool) -> bool:
    with contextlib.suppress(OSError):
        process.poll()
    return process.returncode is None or (own_group and group_exists(process))


def end_all() -> None:
    """Ends every recorded process that may still run (see the module's docstring)."""
    with _started_lock:
        started = list(_started)
    for process, own in reversed(started):
        if own:
            signal_group(process)
        elif process.returncode is None:
            with contextlib.suppress(OSError):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)


def _end_and_pass_on(signum: int, frame: FrameType | None) -> None:
    """The recorded processes ended, then what the signal did before: Python's KeyboardInterrupt
    for SIGINT, and for SIGTERM its default, the end of this process by that signal."""
    end_all()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install() -> None:
    """Records every process started from now on and ends them at this process's exit and on
    SIGTERM/SIGINT (handlers only from the main thread, where Python runs them). Call it after
    registering any exit handler that must run after it (atexit runs the last one first)."""
    if subprocess.Popen.__init__ is not _recording_init:
        subprocess.Popen.__init__ = _recording_init  # type: ignore[method-assign]
        atexit.register(end_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in ENDED_ON:
        current = signal.getsignal(signum)
        if current is not _end_and_pass_on:
            _previous_handlers[signum] = current
            signal.signal(signum, _end_and_pass_on)
