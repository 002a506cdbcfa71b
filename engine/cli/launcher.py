"""`python -m engine.launch` (entry point `engine/launch.py`): a whole cluster here, one process a task.

    python -m engine.launch --num_workers=2 -- --strategy=multi_worker_mirrored ...
    python -m engine.launch --num_workers=2 --num_ps=1 -- --strategy=parameter_server ...

Every task gets free localhost ports and its own TF_CONFIG, exactly what it
would get on separate machines. Without ps tasks every worker runs
`engine.main` (multi-worker mirrored); with ps tasks the chief runs
`engine.main` as the coordinator and workers and ps tasks run
`engine.server`. Output lines are prefixed by task (once: a task that is
not the chief prefixes its own). The launcher exits with
the run's status and never leaves a child behind: on a failure, Ctrl-C or
SIGTERM it ends every task, and each child is killed by the kernel if the
launcher itself dies.

Exit status: without ps tasks, the first failing worker's (0 when all
succeed); under `--max_restarts=N` a task that dies (non-zero exit or a
signal) makes the launcher stop the others and start the whole cluster
again on fresh ports, up to N times, and the run resumes from the latest
checkpoint. A task that fails on bad flags (exit 2) is never restarted.
The time restarts lose (each failed cluster's, from its start to its
successor's) reaches the chief as `goodput.restarts_lost_s` in metrics.json
(`engine.goodput.RESTARTS_LOST_ENV`) and ends the launcher's last line.
With ps tasks, the chief's: a worker that dies is restarted (the
coordinator reschedules its work meanwhile; `--max_worker_restarts`), a ps
task that dies ends the run. `--evaluator` adds an evaluator task that
evaluates each new checkpoint beside training and survives restarts; the
launcher waits for its last evaluation, and its failure is the run's
status when training itself succeeded. SIGINT exits 130, SIGTERM 143.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from engine.cli.flag_names import in_flag_terms
from engine.cluster import Cluster, security_warning
from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, UserError, one_line
from engine.goodput import RESTARTS_ENV, RESTARTS_LOST_ENV

flags.DEFINE_integer("num_workers", 2, "Worker tasks.")
flags.DEFINE_integer("num_ps", 0, "Parameter-server tasks; > 0 adds a chief (the coordinator).")
flags.DEFINE_string("host", "localhost", "Host name the tasks use to reach each other.")
flags.DEFINE_integer(
    "max_worker_restarts", 3, "With ps tasks: how often a dead worker is restarted before the run fails."
)
flags.DEFINE_integer(
    "max_restarts",
    0,
    "Without ps tasks (multi_worker_mirrored): how often the whole cluster is started "
    "again, on fresh ports and from the latest checkpoint, after a task dies.",
)
flags.DEFINE_boolean(
    "evaluator", False, "Add an evaluator task: engine.main evaluating each new checkpoint beside training."
)
FLAGS = flags.FLAGS

PROGRAM = "engine.launch"
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0
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


def _say(line: str) -> None:
    print(f"[launch] {line}", file=sys.stderr, flush=True)


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

    @property
    def training_tasks(self) -> list[Task]:
        return [t for t in self.tasks if not t.is_evaluator]

    @property
    def evaluator(self) -> Task | None:
        return next((t for t in self.tasks if t.is_evaluator), None)

    def start(self, task: Task) -> None:
        env = dict(os.environ, TF_CONFIG=task.cluster.tf_config(), PYTHONUNBUFFERED="1")
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
        _say(
            f"started {task.name} (pid {task.process.pid}) at {task.cluster.address}: {' '.join(task.argv[2:4])}"
        )

    def _relay(self, task: Task, process: subprocess.Popen) -> None:
        assert process.stdout is not None, "started with stdout=PIPE"
        prefix = f"[{task.name}] "
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._print_lock:  # A task that is not the chief prefixes its own lines (engine.cli.console).
                print(line if line.startswith(prefix) else prefix + line, flush=True)
        process.stdout.close()

    def run(self) -> int:
        """Starts every task and returns the run's exit status (after the evaluator's last evaluation)."""
        for task in self.tasks:
            self.start(task)
        status = None
        while True:
            self._watch_evaluator()
            if status is None:
                status = self._check()
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
            self._evaluator_status = _exit_status(code)
            _say(f"{evaluator.name} finished with exit status {self._evaluator_status}")

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
                    _say(f"{task.name} failed with exit status {code}; stopping the other tasks")
                    return _exit_status(code)
                self.restarts += 1
                cause = _cause(task, code, tasks)
                _say(f"restarting the cluster ({self.restarts}/{self.max_restarts}): {cause}")
                self._restart_training()
                return None
            return 0 if all(code == 0 for code in codes) else None
        for task in self.training_tasks:
            code = task.started.poll()
            if code is None:
                continue
            if task.cluster.task_type == "chief":
                _say(f"{task.name} (the coordinator) finished with exit status {code}")
                return _exit_status(code)
            if task.cluster.task_type == "worker" and task.restarts < self.max_worker_restarts:
                task.restarts += 1
                _say(
                    f"{task.name} exited with status {code}; restarting it "
                    f"({task.restarts}/{self.max_worker_restarts}); the coordinator reschedules its work"
                )
                if task.reader is not None:
                    task.reader.join(timeout=5)
                self.start(task)
                continue
            _say(f"{task.name} exited with status {code}; the cluster cannot go on, stopping it")
            return _exit_status(code) or 1
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


def _cause(task: Task, code: int, tasks: list[Task]) -> str:
    """Why the cluster restarts: the failed task, or, where it lost a peer (PEER_LOST_EXIT),
    the peers that still run but stopped answering it (frozen or partitioned)."""
    silent = [t.name for t in tasks if t is not task and t.started.poll() is None]
    if code == PEER_LOST_EXIT and silent:
        return f"{', '.join(silent)} stopped answering ({task.name} {_describe(code)})"
    return f"{task.name} {_describe(code)}"


def _describe(code: int) -> str:
    """'exited with signal 9' or 'exited with status 1'."""
    return f"exited with signal {-code}" if code < 0 else f"exited with status {code}"


def _exit_status(code: int) -> int:
    """A child's status as a shell reports it (128 + signal for a killed child)."""
    return 128 - code if code < 0 else code


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupt(signum, frame) -> None:
    raise _Interrupted(signum)


def check_main_flags(main_flags: Sequence[str]) -> str | None:
    """The error engine.main would die of in every task, found before any task starts:
    its flag parsing, and numbers it cannot count (nan, inf, a timeout past 1e9 s, a port)."""
    from engine.cli import flags as engine_flags  # noqa: F401  (defines engine.main's flags)
    from engine.cli.settings import RunConfig, flag_settings

    try:
        FLAGS(["engine.main", *main_flags])
        values: dict[str, Any] = {name: FLAGS[name].value for name in flag_settings()}
        RunConfig(**values).validate_numbers()
    except flags.Error as error:
        return f"the flags after -- are not engine.main's: {one_line(error)}"
    except UserError as error:
        return f"engine.main would refuse the flags after --: {in_flag_terms(error)}"
    return None


def most_tasks() -> int:
    """MAX_TASKS, or fewer where `ulimit -n` leaves less than FILES_PER_TASK open files a task."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_TASKS
    return max(1, min(MAX_TASKS, (soft - 64) // FILES_PER_TASK))  # 64: the launcher's own files.


def check_launcher_flags() -> None:
    """The launcher's own numbers: counts it can start and watch, restarts it can count."""
    limit = most_tasks()
    bounds = {"num_workers": (1, limit), "num_ps": (0, limit)}
    bounds |= {"max_restarts": (0, MAX_RESTARTS), "max_worker_restarts": (0, MAX_RESTARTS)}
    for name, (low, high) in bounds.items():
        value = getattr(FLAGS, name)  # An integer flag with a default: never None (absl refuses nan).
        if not low <= value <= high:
            raise UserError(f"--{name}={value} must be between {low} and {high}{_why(name, high)}")
    tasks = FLAGS.num_workers + FLAGS.num_ps + (1 if FLAGS.num_ps else 0) + (1 if FLAGS.evaluator else 0)
    if tasks > limit:
        evaluator = " --evaluator" if FLAGS.evaluator else ""
        raise UserError(
            f"--num_workers={FLAGS.num_workers} --num_ps={FLAGS.num_ps}{evaluator} make {tasks} tasks; "
            f"one launcher starts at most {limit}{_why('', limit)}"
        )


def _why(name: str, high: int) -> str:
    if name not in ("", "num_workers", "num_ps"):
        return ""
    if high < MAX_TASKS:
        return f" (the tasks one launcher starts here: {FILES_PER_TASK} open files each under `ulimit -n`)"
    return " (the tasks one launcher starts on this machine)"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with its errors (--num_workers=nan, an unknown flag) as one line and
    exit 2 like every other bad flag, instead of absl's usage text and exit 1."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        print(f"{PROGRAM}: error: {one_line(error)}; see --help", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


def main(argv: list[str]) -> int:
    main_flags = argv[1:]
    try:
        check_launcher_flags()
    except UserError as error:
        print(f"{PROGRAM}: error: {in_flag_terms(error)}", file=sys.stderr)
        return USER_ERROR_EXIT
    if FLAGS.max_restarts and FLAGS.num_ps:
        print(
            f"{PROGRAM}: error: --max_restarts={FLAGS.max_restarts} restarts a multi_worker_mirrored "
            "cluster; with ps tasks use --max_worker_restarts",
            file=sys.stderr,
        )
        return USER_ERROR_EXIT
    problem = check_main_flags(main_flags)
    if problem:
        print(f"{PROGRAM}: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT
    num_workers, num_ps, evaluator, host = FLAGS.num_workers, FLAGS.num_ps, FLAGS.evaluator, FLAGS.host
    num_tasks = num_workers + num_ps + (1 if num_ps else 0) + (1 if evaluator else 0)
    ports = free_ports(num_tasks)
    tasks = make_tasks(cluster_spec(num_workers, num_ps, host, ports, evaluator), main_flags)
    print(security_warning(PROGRAM, ports), file=sys.stderr, flush=True)

    def new_training_tasks() -> list[Task]:
        """The same cluster on fresh ports (the old ones may linger in TIME_WAIT or be taken)."""
        fresh = free_ports(num_tasks)
        spec = cluster_spec(num_workers, num_ps, host, fresh, evaluator)
        return [t for t in make_tasks(spec, main_flags) if not t.is_evaluator]

    launcher = Launcher(
        tasks,
        max_worker_restarts=FLAGS.max_worker_restarts if num_ps else 0,
        max_restarts=FLAGS.max_restarts,
        new_training_tasks=new_training_tasks,
    )
    # Explicitly: a process started from a background shell job inherits
    # SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        status = launcher.run()
    except _Interrupted as interrupt:
        _say(f"{signal.Signals(interrupt.signum).name} received; stopping every task")
        status = 128 + interrupt.signum
    finally:
        launcher.stop()
    lost = (
        f"; {launcher.restarts} restart(s) lost {launcher.restarts_lost_s:.1f} s "
        "(goodput.restarts_lost_s in the chief's metrics.json)"
        if launcher.restarts
        else ""
    )
    _say(f"done with exit status {status}{lost}")
    return status
