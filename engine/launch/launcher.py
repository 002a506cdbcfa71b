"""`python -m engine.launch` (entry point `engine/launch/__main__.py`): a whole cluster here, one process a task.

    python -m engine.launch --num_workers=2 -- --strategy=multi_worker_mirrored ...
    python -m engine.launch --num_workers=2 --num_ps=1 -- --strategy=parameter_server ...
    python -m engine.launch --nnodes=2 --node_rank=I --rendezvous=HOST0:29400 -- --strategy=multi_worker_mirrored

With --nnodes > 1 it is one machine's part of a cluster of several: run it
on every host with its own --node_rank (see `engine.launch.node_launcher`).

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
status when training itself succeeded. SIGINT, SIGTERM and SIGHUP are passed
on to every task, which saves at the step the workers agree on, as one
engine.main does; the launcher then exits 130, 143 or 129 (a second signal
ends every task at once).
"""

from __future__ import annotations

import hashlib
import os
import resource
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import flags

from engine.cli.config.flag_names import in_flag_terms
from engine.cli.config.usage import launch_help
from engine.cli.main_command import SHORT_HELP_FLAGS
from engine.cluster import security_warning
from engine.data_service import DEFAULT_STARTUP_TIMEOUT
from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, UserError, one_line
from engine.launch.data_processes import DataService
from engine.launch.task_processes import (
    FILES_PER_TASK,
    MAX_RESTARTS,
    MAX_TASKS,
    SAVE_GRACE_SECONDS,
    Interrupted,
    Launcher,
    StopSignals,
    Task,
    cluster_spec,
    diagnostics_written,
    forward_report_requests,
    free_ports,
    make_tasks,
    say,
    stopping_line,
)

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
flags.DEFINE_integer(
    "nnodes", 1, "Machines in the cluster: run engine.launch once on each, with its own --node_rank."
)
flags.DEFINE_integer("node_rank", 0, "This machine's number, 0 to --nnodes-1; node 0 serves the rendezvous.")
flags.DEFINE_string(
    "rendezvous",
    None,
    "HOST:PORT of node 0 that every node's launcher reaches, to learn the others' addresses "
    "(only with --nnodes > 1; it exchanges addresses, training runs on TensorFlow's gRPC).",
)
flags.DEFINE_integer("workers_per_node", 1, "With --nnodes > 1: training tasks on each node.")
flags.DEFINE_integer(
    "min_nodes",
    0,
    "With --nnodes > 1: the fewest nodes the run goes on with after a node fails and does not "
    "come back within --rejoin_timeout (0: all of them, the cluster never shrinks).",
)
flags.DEFINE_float(
    "rejoin_timeout",
    60.0,
    "With --min_nodes: seconds a failed node has to join again before the run goes on without it.",
)
flags.DEFINE_string(
    "advertise_host",
    None,
    "With --nnodes > 1: the address the other nodes reach this one at (default: the address "
    "node 0 sees this node's connection come from).",
)
flags.DEFINE_string(
    "rendezvous_secret_file",
    None,
    "With --nnodes > 1: a file holding the secret the run's nodes share, readable by this user "
    "alone (mode 600, else refused, as ssh refuses such a key), at least 16 random characters, "
    "the same on every node; default: the "
    "ENGINE_RENDEZVOUS_SECRET environment variable. Required when --rendezvous is not a loopback "
    "address: without it nothing a connection sends can join, stop or steer the run.",
)
flags.DEFINE_integer(
    "data_workers",
    0,
    "Start a tf.data service here, a dispatcher and this many data workers (python -m engine.data_service), "
    "and pass its address to every task as --data_service: the input pipeline runs in them, not in the "
    "training processes. 0: none.",
)
flags.DEFINE_boolean(
    "evaluator", False, "Add an evaluator task: engine.main evaluating each new checkpoint beside training."
)
FLAGS = flags.FLAGS
PROGRAM = "engine.launch"


def check_main_flags(main_flags: Sequence[str]) -> str | None:
    """The error engine.main would die of in every task, found before any task starts:
    its flag parsing, and numbers it cannot count (nan, inf, a timeout past 1e9 s, a port)."""
    from engine.cli.config import flags as engine_flags  # noqa: F401  (defines engine.main's flags)
    from engine.cli.config.settings import RunConfig, flag_settings

    try:
        FLAGS(["engine.main", *main_flags])
        values: dict[str, Any] = {name: FLAGS[name].value for name in flag_settings()}
        RunConfig(**values).validate_numbers()
    except flags.Error as error:
        return f"the flags after -- are not engine.main's: {one_line(error)}"
    except UserError as error:
        return f"engine.main would refuse the flags after --: {in_flag_terms(error)}"
    if values["dry_run"]:
        return (
            "--dry_run checks a cluster's config on this machine alone, without a cluster: run "
            f"python -m engine.main --dry_run --dry_run_workers={FLAGS['num_workers'].value} ..."
        )
    return None


# engine.main's settings that may differ from one node to the next: where this node's files and
# data are, what it prints, how long it waits, and the cluster that the launchers set up.
NODE_OWN_SETTINGS = frozenset(
    {
        *("worker_hosts", "ps_hosts", "chief_host", "task_type", "task_index", "cluster_resolver"),
        *("slurm_port_base", "model_dir", "data_dir", "eval_file", "export_dir", "predict_input"),
        *("predict_output", "log_prefix", "log_all_tasks", "print_config", "collective_timeout"),
        *("startup_timeout", "heartbeat_timeout", "eval_timeout"),
    }
)
# The launcher's own flags that every node must share: how many nodes, and tasks on each.
SHARED_LAUNCH_FLAGS = ("nnodes", "workers_per_node")


def run_settings() -> dict[str, str | None]:
    """What every node of a multi-host run must be given alike, as text: engine.main's flags
    after -- as `check_main_flags` parsed them (defaults and --flagfile resolved; a
    --config_file by its path and its contents' digest), less `NODE_OWN_SETTINGS`, and the
    launcher's `SHARED_LAUNCH_FLAGS`. No TensorFlow: the launcher compares, engine.main reads."""
    from engine.cli.config.settings import flag_settings
    from engine.launch.rendezvous import LAUNCH_SETTING

    settings: dict[str, str | None] = {}
    for name in flag_settings():
        if name not in NODE_OWN_SETTINGS:
            settings[name] = _setting_text(name, FLAGS[name].value)
    for name in SHARED_LAUNCH_FLAGS:
        settings[LAUNCH_SETTING + name] = str(FLAGS[name].value)
    return settings


def _setting_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if name == "config_file":
        return ",".join(f"{path} (sha256 {_file_digest(path)})" for path in value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return repr(value) if isinstance(value, float) else str(value)


def _file_digest(path: str) -> str:
    """The first 12 hex digits of a regular local file's SHA-256, or `unread` (remote, a FIFO,
    too large): then its path alone is compared."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return "unread"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > 16 << 20:
            return "unread"
        with os.fdopen(os.dup(fd), "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()[:12]
    except OSError:
        return "unread"
    finally:
        os.close(fd)


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
    bounds |= {"nnodes": (1, MAX_TASKS), "node_rank": (0, MAX_TASKS - 1), "workers_per_node": (1, limit)}
    bounds |= {"min_nodes": (0, MAX_TASKS), "data_workers": (0, limit)}
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
    own = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in SHORT_HELP_FLAGS for arg in own):
        print(launch_help(FLAGS.get_flags_for_module(__name__)), end="")
        sys.exit(0)
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
    problem = _data_workers_problem()
    if problem:
        print(f"{PROGRAM}: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT
    if FLAGS.nnodes > 1 or FLAGS.rendezvous:
        return _run_node(main_flags)
    num_workers, num_ps, evaluator, host = FLAGS.num_workers, FLAGS.num_ps, FLAGS.evaluator, FLAGS.host
    num_tasks = num_workers + num_ps + (1 if num_ps else 0) + (1 if evaluator else 0)
    ports = free_ports(num_tasks + (1 if FLAGS.data_workers else 0))
    service = None
    if FLAGS.data_workers:  # Before the tasks, which read from it once they start.
        service = DataService(FLAGS.data_workers, host=host, port=ports[-1], say=say)
        main_flags = [*main_flags, f"--data_service={service.address}"]
    print(security_warning(PROGRAM, ports), file=sys.stderr, flush=True)  # The dispatcher's too.
    ports = ports[:num_tasks]
    if service is not None:
        problem = service.start(timeout=FLAGS.startup_timeout or DEFAULT_STARTUP_TIMEOUT)
        if problem:
            say(f"error: the tf.data service did not start: {problem}; exit {PEER_LOST_EXIT}")
            return PEER_LOST_EXIT
        say(
            f"tf.data service at {service.address}, {FLAGS.data_workers} data worker(s): given as --data_service"
        )
    try:
        return _run_tasks(main_flags, num_tasks, ports, service)
    finally:
        if service is not None:  # After the tasks: they need their input to finish the call they save after.
            service.stop()


def _data_workers_problem() -> str | None:
    """Why --data_workers cannot be honoured with these flags (engine.main's parsed already), or None."""
    if not FLAGS.data_workers:
        return None
    if FLAGS.data_service:
        return (
            f"--data_workers={FLAGS.data_workers} starts a tf.data service here and passes its address; "
            f"drop --data_service={FLAGS.data_service} after --, or --data_workers to use that one"
        )
    if FLAGS.num_ps:
        return "--data_workers feeds multi_worker_mirrored tasks; parameter-server workers build their own input"
    if FLAGS.nnodes > 1 or FLAGS.rendezvous:
        return (
            "--data_workers starts the service on this host for a one-host cluster; with --nnodes > 1 start "
            "python -m engine.data_service on the input hosts and pass --data_service=grpc://HOST:PORT after --"
        )
    return None


def _run_tasks(main_flags: list[str], num_tasks: int, ports: list[int], service: DataService | None) -> int:
    """The training tasks (and the evaluator) on `ports`, watched to their end; the run's status."""
    num_workers, num_ps, evaluator, host = FLAGS.num_workers, FLAGS.num_ps, FLAGS.evaluator, FLAGS.host
    tasks = make_tasks(cluster_spec(num_workers, num_ps, host, ports, evaluator), main_flags)

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
        lost_input=None if service is None else service.lost,
    )
    signals = StopSignals(launcher.kill_now)
    signals.install()
    forward_report_requests(lambda: launcher)
    started = time.time()
    try:
        status = launcher.run()
        signals.stop_under_way()  # A signal from here on: one line, never a traceback from the finally.
    except Interrupted as interrupt:
        say(stopping_line(interrupt.signum, "every task"))
        launcher.stop(grace=SAVE_GRACE_SECONDS, signum=interrupt.signum)
        status = 128 + interrupt.signum
    finally:
        signals.stop_under_way()
        launcher.stop()
    lost = (
        f"; {launcher.restarts} restart(s) lost {launcher.restarts_lost_s:.1f} s "
        "(goodput.restarts_lost_s in the chief's metrics.json)"
        if launcher.restarts
        else ""
    )
    say(f"done with exit status {status}{lost}{diagnostics_written(FLAGS.model_dir, started)}")
    return status


def _run_node(main_flags: list[str]) -> int:
    """This machine's part of a multi-host cluster (`engine.launch.node_launcher`)."""
    from engine.launch.node_launcher import NodeLauncher, NodeOptions, check_node_options
    from engine.launch.rendezvous import parse_address, read_secret, secret_problem

    problem = None
    if FLAGS.num_ps or FLAGS.evaluator:
        problem = "--nnodes > 1 launches multi_worker_mirrored workers only (no --num_ps, no --evaluator)"
    elif not FLAGS.rendezvous:
        problem = (
            f"--nnodes={FLAGS.nnodes} needs --rendezvous=HOST:PORT, node 0's address that every node reaches"
        )
    if problem is None:
        try:
            rendezvous = parse_address(FLAGS.rendezvous)
        except ValueError as error:
            problem = f"--rendezvous={FLAGS.rendezvous}: {error}"
    if problem is None:
        options = NodeOptions(
            nnodes=FLAGS.nnodes,
            node_rank=FLAGS.node_rank,
            rendezvous=rendezvous,
            workers_per_node=FLAGS.workers_per_node,
            min_nodes=FLAGS.min_nodes,
            max_restarts=FLAGS.max_restarts,
            startup_timeout=FLAGS.startup_timeout,  # engine.main's, parsed from the flags after --
            rejoin_timeout=FLAGS.rejoin_timeout,
            heartbeat_timeout=FLAGS.heartbeat_timeout,
            host=FLAGS.advertise_host,
            model_dir=FLAGS.model_dir,  # engine.main's, where its tasks write their diagnostics
        )
        problem = check_node_options(options)
    secret = None
    if problem is None:
        try:
            secret = read_secret(FLAGS.rendezvous_secret_file, os.environ)
        except ValueError as error:
            problem = str(error)
    if problem is None:
        problem = secret_problem(rendezvous[0], secret)
    if problem is not None:
        print(f"{PROGRAM}: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT
    return NodeLauncher(options, main_flags, secret=secret, settings=run_settings()).run()
