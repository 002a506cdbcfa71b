"""`engine.launch --data_workers=N`: a tf.data service dispatcher and N data workers beside the
training tasks on this host, each a process of `python -m engine.data_service`.

They start before the training tasks (bounded: a server that has not said it serves within
the start-up bound, or that exits, fails the launch in one line, exit 69, nothing left
running), are watched with them (a data worker that dies while others serve is said in one
line and the run goes on: the service moves its readers to the workers left; the dispatcher or
the last data worker dying ends the run in one line, exit 69: the training tasks get the
launcher's stop and save if they can; the latest checkpoint stays), and stop after them: the
tasks need their input to finish the call they save after. They run in a session of their own,
so a terminal's Ctrl-C reaches the launcher and the tasks, not the input they still need; the
kernel kills each one when the launcher dies (PR_SET_PDEATHSIG), as it does the tasks.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from engine.data_service import PROGRAM, READY

_PR_SET_PDEATHSIG = 1
STOP_SECONDS = 5.0


@dataclasses.dataclass
class DataProcess:
    """One server of the service: its name in the launcher's lines, its command, its process."""

    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    last_line: str = ""

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


def _die_with_parent() -> None:
    """In the child: the kernel kills it when the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _exited(process: DataProcess) -> str:
    """'data_worker:0 (pid N) of the tf.data service exited with signal 9'."""
    code = process.exit_code()
    assert process.process is not None and code is not None, "only for a process that has exited"
    how = f"signal {-code}" if code < 0 else f"status {code}"
    return f"{process.name} (pid {process.process.pid}) of the tf.data service exited with {how}"


class DataService:
    """The dispatcher and `num_workers` data workers on `host`, the dispatcher at `port`."""

    def __init__(self, num_workers: int, *, host: str, port: int, say: Callable[[str], None]):
        self.address = f"grpc://{host}:{port}"
        self.say = say
        python = [sys.executable, "-m", PROGRAM]
        self.processes = [DataProcess("dispatcher", [*python, "--dispatcher", f"--port={port}"])]
        self.processes += [
            DataProcess(
                f"data_worker:{index}",
                [*python, "--worker", f"--dispatcher_address={host}:{port}", f"--host={host}", "--port=0"],
            )
            for index in range(num_workers)
        ]
        self._print_lock = threading.Lock()
        self._said_gone: list[DataProcess] = []  # Data workers gone while others serve, said once each.

    def start(self, timeout: float) -> str | None:
        """Starts the dispatcher, then the workers, each awaited until it serves; None, or the one
        line of why not (every process started is stopped then)."""
        dispatcher, workers = self.processes[0], self.processes[1:]
        problem = self._start_and_wait([dispatcher], timeout)
        if problem is None:
            problem = self._start_and_wait(workers, timeout)
        if problem is not None:
            self.stop()
        return problem

    def _start_and_wait(self, processes: list[DataProcess], timeout: float) -> str | None:
        for process in processes:
            self._start(process)
        deadline = time.monotonic() + timeout
        for process in processes:
            while not process.ready.wait(0.1):
                code = process.exit_code()
                if code is not None:
                    last = process.last_line or "no output"
                    return f"{process.name} exited with status {code} before serving: {last}"
                if time.monotonic() >= deadline:
                    return f"{process.name} did not serve within {timeout:g} s (the start-up bound)"
        return None

    def _start(self, process: DataProcess) -> None:
        process.process = subprocess.Popen(
            process.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            start_new_session=True,  # A terminal's Ctrl-C is the launcher's to pass on, after the tasks.
        )
        threading.Thread(target=self._relay, args=(process,), daemon=True).start()
        self.say(f"started {process.name} (pid {process.process.pid}): {' '.join(process.argv[2:])}")

    def _relay(self, process: DataProcess) -> None:
        assert process.process is not None and process.process.stdout is not None, "started with a pipe"
        prefix = f"[{process.name}] "
        for raw in iter(process.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if not line.strip():
                continue
            process.last_line = line
            if READY in line:
                process.ready.set()
            with self._print_lock, contextlib.suppress(OSError, ValueError):
                print(prefix + line, file=sys.stdout, flush=True)
        process.process.stdout.close()

    def lost(self) -> str | None:
        """Why the training input is gone (the dispatcher, or the last data worker, exited), in one
        line; None while it is not. A data worker that exits while others serve is said once: the
        service goes on with them (the run's readers move to the workers left)."""
        dispatcher, workers = self.processes[0], self.processes[1:]
        if dispatcher.exit_code() is not None:
            return f"{_exited(dispatcher)}; the training input is gone"
        gone = [worker for worker in workers if worker.exit_code() is not None]
        if len(gone) == len(workers):
            last = next((worker for worker in gone if worker not in self._said_gone), gone[-1])
            return f"{_exited(last)}; the training input is gone (no data worker left)"
        for worker in gone:
            if worker not in self._said_gone:
                self._said_gone.append(worker)
                left = len(workers) - len(gone)
                self.say(f"warning: {_exited(worker)}; the run goes on with the {left} data worker(s) left")
        return None

    def stop(self) -> None:
        """SIGTERM to every server, SIGKILL after STOP_SECONDS, reaped."""
        live = [p.process for p in self.processes if p.process is not None and p.process.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for process in live:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_SECONDS)
