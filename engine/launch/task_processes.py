"""The processes of one node's tasks: start each with its TF_CONFIG, relay its output with
the task's prefix, watch them, restart them as the local launcher's rules say, stop them.

`engine.launch.launcher` (a whole cluster on this machine) and `engine.launch.node_launcher`
(this machine's part of a cluster of several) both run their tasks through `Launcher`.
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
from collections.abc import Callable, Sequence

from engine.cli.process.preemption import (
    DIAGNOSTICS_SIGNAL,
    LAUNCHER_PID_ENV,
    STOP_SIGNALS,
    leave_a_closed_terminal,
)
from engine.cluster import Cluster
from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, final_status
from engine.goodput import RESTARTS_ENV, RESTARTS_LOST_ENV
from engine.launch.rendezvous import SECRET_ENV

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0
# After SIGINT, SIGTERM or SIGHUP to a launcher: how long its tasks have to finish their compiled
# call and save at the step they agree on (a second signal ends them at once), as a pod's
# terminationGracePeriodSeconds in examples/kubernetes.
SAVE_GRACE_SECONDS = 120.0
# How long a task killed with SIGKILL may take to go (one stuck in the kernel, on a dead NFS
# mount, never does): the launcher goes on without it after this.
KILL_WAIT_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1
# The processes one launcher starts and watches on this machine (each holds a port's socket
# while the ports are chosen, then the pipe of its output) and the restarts it counts.
MAX_TASKS = 1024
FILES_PER_TASK = 2
MAX_RESTARTS = 2**31 - 1


@dataclasses.dataclass
class Task:
    """One process of the cluster and how to (re)start it."""

    cluster: Cluster
    argv: list[str]
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    restarts: int = 0
    last_line: str = ""  # Its last output line: a lost peer's name, for a restart line on another node.

    @property
    def name(self) -> str:
        return f"{self.cluster.task_type}:{self.cluster.task_index}"

    @property
    def started(self) -> subprocess.Popen:
        """The process, for a task `Launcher.start` has started (every one before it is watched)."""
        assert self.process is not None, f"{self.name} was never started"
        return self.process

    @property
    def is_evaluator(self) -> bool:
        return self.cluster.task_type == "evaluator"

    @property
    def runs_main(self) -> bool:
        """engine.main (it saves on a stop signal), not an engine.server (a parameter-server
        cluster's worker or ps task, which ends when its launcher says)."""
        return "engine.server" not in self.argv


def free_ports(count: int, host: str = "localhost") -> list[int]:
    """Ports the OS says are free now: bound to port 0 together, then released."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def cluster_spec(
    num_workers: int, num_ps: int, host: str, ports: Sequence[int], evaluator: bool = False
) -> dict[str, tuple[str, ...]]:
    """chief (with ps tasks only), workers, ps tasks and the evaluator on consecutive ports."""
    addresses = iter(f"{host}:{port}" for port in ports)
    spec: dict[str, tuple[str, ...]] = {}
    if num_ps:
        spec["chief"] = (next(addresses),)
    spec["worker"] = tuple(next(addresses) for _ in range(num_workers))
    if num_ps:
        spec["ps"] = tuple(next(addresses) for _ in range(num_ps))
    if evaluator:
        spec["evaluator"] = (next(addresses),)
    return spec


def make_tasks(spec: dict[str, tuple[str, ...]], main_flags: Sequence[str]) -> list[Task]:
    """engine.main for the chief or, without a chief, every worker; engine.server otherwise."""
    python = [sys.executable, "-m"]
    tasks = []
    for task_type, addresses in spec.items():
        for index in range(len(addresses)):
            runs_main = task_type in ("chief", "evaluator") or "chief" not in spec
            argv = python + (["engine.main", *main_flags] if runs_main else ["engine.server"])
            tasks.append(Task(Cluster(spec, task_type, index), argv))
    return tasks


def _die_with_parent() -> None:
    """In the child: the kernel kills it when the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def say(line: str) -> None:
    write_line(f"[launch] {line}", sys.stderr)


def write_line(line: str, stream) -> None:
    """`line` to `stream`; nothing when it cannot take it (a terminal closed under a SIGHUP):
    the launcher still has its tasks to stop."""
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):
        pass


class Launcher:
    """Starts, watches and stops the tasks of one local cluster.

    `new_training_tasks` makes the training tasks of a fresh cluster (new
    ports) for a restart under `max_restarts`; the evaluator is kept.
    """

    def __init__(
        self,
        tasks: list[Task],
        *,
        max_worker_restarts: int = 0,
        max_restarts: int = 0,
        new_training_tasks: Callable[[], list[Task]] | None = None,
        say: Callable[[str], None] = say,
        lost_input: Callable[[], str | None] | None = None,
    ):
        self.tasks = tasks
        self.max_worker_restarts = max_worker_restarts
        self.max_restarts = max_restarts
        self.restarts = 0
        # Wall time lost to restarts: each failed cluster's, from its start to its successor's.
        self.restarts_lost_s = 0.0
        self._cluster_started = time.monotonic()
        self._new_training_tasks = new_training_tasks
        self.parameter_server = any(t.cluster.task_type == "ps" for t in tasks)
        self._print_lock = threading.Lock()
        self._evaluator_status: int | None = None
        self.say = say  # Its own lines: "[launch] ...", or "[launch node I] ..." on one of several nodes.
        # What the training input lost (a server of --data_workers' tf.data service gone), or None.
        self.lost_input = lost_input

    @property
    def training_tasks(self) -> list[Task]:
        return [t for t in self.tasks if not t.is_evaluator]

    @property
    def evaluator(self) -> Task | None:
        return next((t for t in self.tasks if t.is_evaluator), None)

    def start(self, task: Task) -> None:
        env = dict(os.environ, TF_CONFIG=task.cluster.tf_config(), PYTHONUNBUFFERED="1")
        # Its stop signals are this one's (engine.cli.process.preemption).
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env.pop(SECRET_ENV, None)  # The rendezvous is the launcher's: no task needs its secret.
        if self.parameter_server:  # Workers' RPCs fail fast, so the coordinator reschedules.
            env.setdefault("GRPC_FAIL_FAST", "use_caller")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if self.restarts and not task.is_evaluator:  # The chief records them in its goodput.
            env.update({RESTARTS_ENV: str(self.restarts), RESTARTS_LOST_ENV: f"{self.restarts_lost_s:.3f}"})
        task.process = subprocess.Popen(
            task.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        task.reader = threading.Thread(target=self._relay, args=(task, task.process), daemon=True)
        task.reader.start()
        self.say(
            f"started {task.name} (pid {task.process.pid}) at {task.cluster.address}: {' '.join(task.argv[2:4])}"
        )

    def _relay(self, task: Task, process: subprocess.Popen) -> None:
        assert process.stdout is not None, "started with stdout=PIPE"
        prefix = f"[{task.name}] "
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.strip():
                task.last_line = line.removeprefix(prefix)
            # A task that is not the chief prefixes its own lines (engine.cli.process.console).
            with self._print_lock:
                write_line(line if line.startswith(prefix) else prefix + line, sys.stdout)
        process.stdout.close()  # Read to the end even with nowhere to print: a task never blocks on a full pipe.

    def run(self) -> int:
        """Starts every task and returns the run's exit status (after the evaluator's last evaluation)."""
        for task in self.tasks:
            self.start(task)
        status = None
        while True:
            self._watch_evaluator()
            # First: a task failing on its lost input would otherwise be taken for the cause.
            lost = None if status is not None or self.lost_input is None else self.lost_input()
            if status is None and lost is None:
                status = self._check()
            if lost is not None:  # The tasks get the launcher's stop: a task not waiting on input saves.
                self.say(
                    f"{lost}; stopping the training tasks (the latest checkpoint is kept), exit {PEER_LOST_EXIT}"
                )
                return PEER_LOST_EXIT
            if status is not None and (
                status != 0 or self._evaluator_status is not None or self.evaluator is None
            ):
                return status or self._evaluator_status or 0
            time.sleep(POLL_SECONDS)

    def _watch_evaluator(self) -> None:
        """The evaluator's end is logged once; it never stops training."""
        evaluator = self.evaluator
        if evaluator is None or self._evaluator_status is not None:
            return
        code = evaluator.started.poll()
        if code is not None:
            self._evaluator_status = shell_status(code)
            self.say(f"{evaluator.name} finished with exit status {self._evaluator_status}")

    def _check(self) -> int | None:
        """None while the training goes on, else its exit status."""
        code: int | None
        if not self.parameter_server:
            tasks = self.training_tasks
            codes = [task.started.poll() for task in tasks]
            failed = [(task, code) for task, code in zip(tasks, codes, strict=True) if code not in (None, 0)]
            if failed:
                # The task killed by a signal is the cause; the others failed because of it.
                task, code = min(failed, key=lambda failure: failure[1] >= 0)
                if code == USER_ERROR_EXIT or self.restarts >= self.max_restarts:
                    status, why = final_status(
                        shell_status(code),
                        f"{task.name} failed with exit status {code}",
                        restarts=self.max_restarts,
                        flag="--max_restarts",
                    )
                    self.say(f"{why}; stopping the other tasks")
                    return status
                self.restarts += 1
                cause = cause_of(task, code, tasks)
                self.say(f"restarting the cluster ({self.restarts}/{self.max_restarts}): {cause}")
                self._restart_training()
                return None
            return 0 if all(code == 0 for code in codes) else None
        for task in self.training_tasks:
            code = task.started.poll()
            if code is None:
                continue
            if task.cluster.task_type == "chief":
                self.say(f"{task.name} (the coordinator) finished with exit status {code}")
                return shell_status(code)
            if task.cluster.task_type == "worker" and task.restarts < self.max_worker_restarts:
                task.restarts += 1
                self.say(
                    f"{task.name} exited with status {code}; restarting it "
                    f"({task.restarts}/{self.max_worker_restarts}); the coordinator reschedules its work"
                )
                if task.reader is not None:
                    task.reader.join(timeout=5)
                self.start(task)
                continue
            status, why = final_status(
                shell_status(code) or 1,
                f"{task.name} exited with status {code}",
                restarts=self.max_worker_restarts if task.cluster.task_type == "worker" else 0,
                flag="--max_worker_restarts",
            )
            self.say(f"{why}; the cluster cannot go on, stopping it")
            return status
        return None

    def _restart_training(self) -> None:
        """Every training task stopped and started again as a new cluster on fresh ports."""
        old = self.training_tasks
        self._terminate(old, time.monotonic() + STOP_GRACE_SECONDS)
        for task in old:
            if task.reader is not None:
                task.reader.join(timeout=5)
        assert self._new_training_tasks is not None, "max_restarts > 0 comes with new_training_tasks"
        fresh = self._new_training_tasks()
        self.tasks = [t for t in self.tasks if t.is_evaluator] + fresh
        now = time.monotonic()
        self.restarts_lost_s += now - self._cluster_started
        self._cluster_started = now
        for task in fresh:
            self.start(task)

    def stop(self, grace: float = STOP_GRACE_SECONDS, signum: int = signal.SIGTERM) -> None:
        """`signum` to every live engine.main task (SIGTERM to the others), SIGKILL after
        `grace` seconds, then reap.

        With parameter servers the coordinator goes first: on the signal it
        finishes its loop and saves, which needs the workers (to finish the
        loop) and the ps tasks (which hold the variables) still running.
        A task that got the same stop from elsewhere too (a terminal's Ctrl-C
        reaches the launcher's whole process group) does not count this one
        as a second signal: it comes from its launcher (engine.cli.process.preemption).
        """
        deadline = time.monotonic() + grace  # for the whole stop, not per task
        first = [t for t in self.tasks if self.parameter_server and t.cluster.task_type == "chief"]
        self._terminate(first, deadline, signum)
        self._terminate([t for t in self.tasks if t not in first], deadline, signum)
        for task in self.tasks:
            if task.reader is not None:
                task.reader.join(timeout=max(0.1, deadline + 2 - time.monotonic()))

    def ask_for_reports(self) -> None:
        """SIGUSR1 to every live engine.main task: each writes what it is doing to
        `<model_dir>/diagnostics/<task>.txt` and goes on (engine.diagnostics). An engine.server
        task (a parameter-server cluster's worker or ps) is left alone: SIGUSR1 would end it."""
        asked, left = [], []
        for task in self.tasks:
            if task.process is None or task.process.poll() is not None:
                continue
            if not task.runs_main:
                left.append(task.name)
                continue
            with contextlib.suppress(ProcessLookupError):
                task.started.send_signal(DIAGNOSTICS_SIGNAL)
                asked.append(task.name)
        unasked = f"; {', '.join(left)} (engine.server) take no such request" if left else ""
        self.say(
            f"SIGUSR1 received: asked {', '.join(asked) or 'no running task'} to write what it is doing "
            f"to <model_dir>/diagnostics/<task>.txt{unasked}"
        )

    def kill_now(self) -> None:
        """SIGKILL to every live task, reaped within KILL_WAIT_SECONDS in all: a second stop
        signal to the launcher, which exits right after and leaves no task behind."""
        live = [task.started for task in self.tasks if task.process is not None and task.process.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        for process in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.01, deadline - time.monotonic()))

    def _terminate(self, tasks: list[Task], deadline: float, signum: int = signal.SIGTERM) -> None:
        live = [t for t in tasks if t.process is not None and t.process.poll() is None]
        for task in live:
            with contextlib.suppress(ProcessLookupError):
                task.started.send_signal(signum if task.runs_main else signal.SIGTERM)
        for task in live:
            try:
                task.started.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                task.started.kill()
                try:
                    task.started.wait(timeout=KILL_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    self.say(
                        f"warning: {task.name} (pid {task.started.pid}) is still there {KILL_WAIT_SECONDS:g} s "
                        "after SIGKILL (stuck in the kernel, e.g. on a lost file system); going on without it"
                    )


def forward_report_requests(launcher: Callable[[], Launcher | None]) -> None:
    """From now on SIGUSR1 to this launcher asks its engine.main tasks what they are doing
    (`Launcher.ask_for_reports`) instead of ending it, as the signal's default would."""

    def handle(signum: int, frame: object) -> None:
        current = launcher()
        if current is not None:
            current.ask_for_reports()

    signal.signal(DIAGNOSTICS_SIGNAL, handle)


def cause_of(task: Task, code: int, tasks: list[Task]) -> str:
    """Why the cluster restarts: the failed task, or, where it lost a peer (PEER_LOST_EXIT),
    the peers that still run but stopped answering it (frozen or partitioned)."""
    silent = [t.name for t in tasks if t is not task and t.started.poll() is None]
    if code == PEER_LOST_EXIT and silent:
        return f"{', '.join(silent)} stopped answering ({task.name} {describe_exit(code)})"
    return f"{task.name} {describe_exit(code)}"


def diagnostics_written(model_dir: str | None, since: float) -> str:
    """'; diagnostics of worker-0, worker-1 in DIR' for the reports tasks wrote into
    `<model_dir>/diagnostics` (engine.diagnostics) since `since` (time.time()): a lost peer or
    a SIGUSR1; "" when none did (or the model_dir is not a local path this launcher sees)."""
    if not model_dir:
        return ""
    directory = os.path.join(model_dir, "diagnostics")  # engine.diagnostics.DIAGNOSTICS_DIR
    try:
        names = sorted(
            entry.name[: -len(".txt")]
            for entry in os.scandir(directory)
            if entry.name.endswith(".txt") and entry.is_file() and entry.stat().st_mtime >= since
        )
    except OSError:
        return ""
    return f"; diagnostics of {', '.join(names)} in {directory}" if names else ""


def describe_exit(code: int) -> str:
    """'exited with signal 9' or 'exited with status 1'."""
    return f"exited with signal {-code}" if code < 0 else f"exited with status {code}"


def shell_status(code: int) -> int:
    """A child's status as a shell reports it (128 + signal for a killed child)."""
    return 128 - code if code < 0 else code


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP to a launcher, raised where it waits, so that it stops its tasks."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stopping_line(signum: int, what: str) -> str:
    """A launcher's line on its first stop signal."""
    name = signal.Signals(signum).name
    return (
        f"{name} received; stopping {what}: each task finishes its compiled call and saves at the step "
        f"the workers agree on (at most {SAVE_GRACE_SECONDS:g} s); send {name} again to end them at once"
    )


class StopSignals:
    """A launcher's SIGINT, SIGTERM and SIGHUP (a closed ssh session), as engine.main takes them.

    The first raises `Interrupted` where the launcher waits, and the launcher
    passes the signal on to its tasks, which save at the step they agree on
    (`Launcher.stop`). A second, while they save, ends them (`kill_tasks`) and
    the launcher at once with one line and 128+signal, as a second signal
    ends engine.main: it never raises into the first one's clean-up, which
    printed a traceback. After SIGHUP the launcher's lines go nowhere instead
    of failing on the closed terminal.

    Once the launcher stops its tasks anyway (its run ended, failed or not: `stop_under_way`),
    a first signal raises nothing either: it is said in one line, the stop goes on, and the
    launcher's exit status stays its run's. Raised there, it ended the launcher with an
    `Interrupted: 15` traceback.
    """

    def __init__(
        self,
        kill_tasks: Callable[[], None],
        *,
        say: Callable[[str], None] = say,
        exit: Callable[[int], None] = os._exit,
    ):
        self.kill_tasks = kill_tasks
        self.say = say
        self.exit = exit
        self.signum: int | None = None
        self._under_way = False  # The tasks are being stopped whatever comes.

    def stop_under_way(self) -> None:
        """From now on a first signal does not raise `Interrupted`: the launcher is stopping its
        tasks already (call it inside the `try` whose `except Interrupted` handles the signals
        before, so that none falls between the two)."""
        self._under_way = True

    def install(self) -> None:
        # Explicitly: a process started from a background shell job inherits SIGINT *ignored*.
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            leave_a_closed_terminal()
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            if self._under_way:
                self.say(
                    f"{name} received while every task is being stopped already (at most "
                    f"{STOP_GRACE_SECONDS:g} s); send {name} again to end them at once"
                )
                return
            raise Interrupted(signum)
        self.kill_tasks()
        self.say(
            f"{name} received again: every task ended at once (SIGKILL), without its save; exit {128 + signum}"
        )
        self.exit(128 + signum)
