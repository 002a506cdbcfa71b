"""`python -m engine.launch`: a whole cluster on this machine, one process a task.

    python -m engine.launch --num_workers=2 -- --strategy=multi_worker_mirrored ...
    python -m engine.launch --num_workers=2 --num_ps=1 -- --strategy=parameter_server ...

Every task gets free localhost ports and its own TF_CONFIG, exactly what it
would get on separate machines. Without ps tasks every worker runs
`engine.main` (multi-worker mirrored); with ps tasks the chief runs
`engine.main` as the coordinator and workers and ps tasks run
`engine.server`. Output lines are prefixed by task. The launcher exits with
the run's status and never leaves a child behind: on a failure, Ctrl-C or
SIGTERM it ends every task, and each child is killed by the kernel if the
launcher itself dies.

Exit status: without ps tasks, the first failing worker's (0 when all
succeed). With ps tasks, the chief's: a worker that dies is restarted (the
coordinator reschedules its work meanwhile), a ps task that dies ends the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from absl import app, flags

from engine.cluster import Cluster, security_warning

flags.DEFINE_integer("num_workers", 2, "Worker tasks.")
flags.DEFINE_integer("num_ps", 0, "Parameter-server tasks; > 0 adds a chief (the coordinator).")
flags.DEFINE_string("host", "localhost", "Host name the tasks use to reach each other.")
flags.DEFINE_integer("max_worker_restarts", 3,
                     "With ps tasks: how often a dead worker is restarted before the run fails.")
FLAGS = flags.FLAGS

PROGRAM = "engine.launch"
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class Task:
    """One process of the cluster and how to (re)start it."""

    cluster: Cluster
    argv: list[str]
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    restarts: int = 0

    @property
    def name(self) -> str:
        return f"{self.cluster.task_type}:{self.cluster.task_index}"


def free_ports(count: int, host: str = "localhost") -> list[int]:
    """Ports the OS says are free now: bound to port 0 together, then released."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def cluster_spec(num_workers: int, num_ps: int, host: str, ports: Sequence[int]) -> dict[str, tuple[str, ...]]:
    """chief (with ps tasks only), workers and ps tasks on consecutive ports."""
    addresses = iter(f"{host}:{port}" for port in ports)
    spec: dict[str, tuple[str, ...]] = {}
    if num_ps:
        spec["chief"] = (next(addresses),)
    spec["worker"] = tuple(next(addresses) for _ in range(num_workers))
    if num_ps:
        spec["ps"] = tuple(next(addresses) for _ in range(num_ps))
    return spec


def make_tasks(spec: dict[str, tuple[str, ...]], main_flags: Sequence[str]) -> list[Task]:
    """engine.main for the chief or, without a chief, every worker; engine.server otherwise."""
    python = [sys.executable, "-m"]
    tasks = []
    for task_type, addresses in spec.items():
        for index in range(len(addresses)):
            runs_main = task_type == "chief" or "chief" not in spec
            argv = python + (["engine.main", *main_flags] if runs_main else ["engine.server"])
            tasks.append(Task(Cluster(spec, task_type, index), argv))
    return tasks


def _die_with_parent() -> None:
    """In the child: the kernel kills it when the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _say(line: str) -> None:
    print(f"[launch] {line}", file=sys.stderr, flush=True)


class Launcher:
    """Starts, watches and stops the tasks of one local cluster."""

    def __init__(self, tasks: list[Task], *, max_worker_restarts: int = 0):
        self.tasks = tasks
        self.max_worker_restarts = max_worker_restarts
        self.parameter_server = any(t.cluster.task_type == "ps" for t in tasks)
        self._print_lock = threading.Lock()

    def start(self, task: Task) -> None:
        env = dict(os.environ, TF_CONFIG=task.cluster.tf_config(), PYTHONUNBUFFERED="1")
        if self.parameter_server:  # Workers' RPCs fail fast, so the coordinator reschedules.
            env.setdefault("GRPC_FAIL_FAST", "use_caller")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        task.process = subprocess.Popen(
            task.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )
        task.reader = threading.Thread(target=self._relay, args=(task, task.process), daemon=True)
        task.reader.start()
        _say(f"started {task.name} (pid {task.process.pid}) at {task.cluster.address}: "
             f"{' '.join(task.argv[2:4])}")

    def _relay(self, task: Task, process: subprocess.Popen) -> None:
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._print_lock:
                print(f"[{task.name}] {line}", flush=True)
        process.stdout.close()

    def run(self) -> int:
        """Starts every task and returns the run's exit status."""
        for task in self.tasks:
            self.start(task)
        while True:
            status = self._check()
            if status is not None:
                return status
            time.sleep(POLL_SECONDS)

    def _check(self) -> int | None:
        """None while the run goes on, else its exit status."""
        if not self.parameter_server:
            codes = [task.process.poll() for task in self.tasks]
            for task, code in zip(self.tasks, codes):
                if code not in (None, 0):
                    _say(f"{task.name} failed with exit status {code}; stopping the other tasks")
                    return _exit_status(code)
            return 0 if all(code == 0 for code in codes) else None
        for task in self.tasks:
            code = task.process.poll()
            if code is None:
                continue
            if task.cluster.task_type == "chief":
                _say(f"{task.name} (the coordinator) finished with exit status {code}")
                return _exit_status(code)
            if task.cluster.task_type == "worker" and task.restarts < self.max_worker_restarts:
                task.restarts += 1
                _say(f"{task.name} exited with status {code}; restarting it "
                     f"({task.restarts}/{self.max_worker_restarts}); the coordinator reschedules its work")
                task.reader.join(timeout=5)
                self.start(task)
                continue
            _say(f"{task.name} exited with status {code}; the cluster cannot go on, stopping it")
            return _exit_status(code) or 1
        return None

    def stop(self) -> None:
        """SIGTERM to every live task, SIGKILL after a grace period, then reap.

        With parameter servers the coordinator goes first: on SIGTERM it
        finishes its loop and saves, which needs the workers (to finish the
        loop) and the ps tasks (which hold the variables) still running.
        """
        deadline = time.monotonic() + STOP_GRACE_SECONDS  # for the whole stop, not per task
        first = [t for t in self.tasks if self.parameter_server and t.cluster.task_type == "chief"]
        self._terminate(first, deadline)
        self._terminate([t for t in self.tasks if t not in first], deadline)
        for task in self.tasks:
            if task.reader is not None:
                task.reader.join(timeout=max(0.1, deadline + 2 - time.monotonic()))

    def _terminate(self, tasks: list[Task], deadline: float) -> None:
        live = [t.process for t in tasks if t.process is not None and t.process.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in live:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _exit_status(code: int) -> int:
    """A child's status as a shell reports it (128 + signal for a killed child)."""
    return 128 - code if code < 0 else code


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    main_flags = argv[1:]
    if FLAGS.num_workers < 1:
        print(f"{PROGRAM}: error: --num_workers={FLAGS.num_workers} must be at least 1", file=sys.stderr)
        return 2
    if FLAGS.num_ps < 0:
        print(f"{PROGRAM}: error: --num_ps={FLAGS.num_ps} must be >= 0", file=sys.stderr)
        return 2
    num_tasks = FLAGS.num_workers + FLAGS.num_ps + (1 if FLAGS.num_ps else 0)
    ports = free_ports(num_tasks)
    tasks = make_tasks(cluster_spec(FLAGS.num_workers, FLAGS.num_ps, FLAGS.host, ports), main_flags)
    print(security_warning(PROGRAM, ports), file=sys.stderr, flush=True)
    launcher = Launcher(tasks, max_worker_restarts=FLAGS.max_worker_restarts if FLAGS.num_ps else 0)
    # Explicitly: a process started from a background shell job inherits
    # SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        status = launcher.run()
    except KeyboardInterrupt:
        _say("interrupted; stopping every task")
        status = 130
    finally:
        launcher.stop()
    _say(f"done with exit status {status}")
    return status


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
