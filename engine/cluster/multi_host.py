"""Strategies that span several processes or machines: MultiWorkerMirrored,
ParameterServer and TPU, built on tf.distribute's own gRPC runtime.

`engine.strategy.build_strategy` calls `build_multi_host_strategy`; the
cluster itself is resolved (and checked) by `engine.cluster`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import tensorflow as tf

from engine import diagnostics
from engine.cluster import Cluster, check_strategy_cluster
from engine.errors import UserError, one_line
from engine.logger import EVERY_TASK, logger
from engine.options import (
    COMMUNICATIONS,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
)

_STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # engine.cli.process.preemption's
WATCHDOG_GRACE_SECONDS = 3.0
# Sent by the start-up watchdog before it ends a task that timed out: faulthandler's C handler writes
# every thread's Python stack then, although TensorFlow's connecting call holds the GIL.
STARTUP_STACKS_SIGNAL = signal.SIGUSR2


@dataclasses.dataclass(frozen=True)
class MultiHostOptions:
    """How a multi-host strategy talks to its cluster."""

    cluster: Cluster | None = None
    communication: str = "auto"
    # Seconds a collective may wait for its peers: a dead worker then ends
    # the run with an error instead of hanging it. 0 waits forever.
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    tpu: str | None = None
    # Seconds the start-up (connecting to every peer) may take; 0 waits forever.
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    # Seconds without a heartbeat after which a multi_worker_mirrored peer counts as lost:
    # a frozen or partitioned peer ends the run after about this long (engine.cluster.peer_loss).
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    # Held while TensorFlow's start-up call runs. That call holds the GIL, so a signal
    # handler written in Python could never act: the command line passes a guard that
    # leaves SIGTERM/SIGINT pending, for the start-up watchdog to see and end the task.
    startup_guard: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    # Where a task whose start-up times out writes its report (`engine.diagnostics`): its stacks,
    # where TensorFlow waited. None: no report.
    diagnostics_dir: str | None = None

    def check(self, strategy: str) -> None:
        self.check_settings(strategy)
        check_strategy_cluster(strategy, self.cluster)

    def check_settings(self, strategy: str) -> None:
        """What needs no cluster: the collectives, the timeouts, the TPU against `strategy`."""
        if self.communication not in COMMUNICATIONS:
            raise UserError(
                f"unknown `communication={self.communication!r}`; choose one of: {', '.join(COMMUNICATIONS)}"
            )
        if self.collective_timeout < 0:
            raise UserError(f"`collective_timeout={self.collective_timeout!r}` must be >= 0 (0: no timeout)")
        if self.startup_timeout < 0:
            raise UserError(f"`startup_timeout={self.startup_timeout!r}` must be >= 0 (0: no timeout)")
        if self.heartbeat_timeout <= 0:
            raise UserError(f"`heartbeat_timeout={self.heartbeat_timeout!r}` must be > 0")
        if strategy == "tpu" and not self.tpu:
            raise UserError("`strategy='tpu'` needs `tpu='local'` (a TPU VM) or `tpu='grpc://HOST:PORT'`")
        if self.tpu and strategy != "tpu":
            raise UserError(f"`tpu={self.tpu!r}` needs `strategy='tpu'`")


def build_multi_host_strategy(name: str, options: MultiHostOptions) -> tf.distribute.Strategy:
    options.check(name)
    if name == "multi_worker_mirrored":
        with bounded_startup(
            options.cluster,
            options.startup_timeout,
            guard=options.startup_guard,
            report_to=options.diagnostics_dir,
        ):
            if options.cluster is not None:
                _configure_coordination(options.cluster, options.startup_timeout, options.heartbeat_timeout)
            strategy = _multi_worker_mirrored(options)
            if options.cluster is not None and options.cluster.num_workers > 1:
                _barrier(strategy)  # The first collective waits for every worker too.
        return strategy
    if name == "parameter_server":
        with bounded_startup(
            options.cluster,
            options.startup_timeout,
            guard=options.startup_guard,
            report_to=options.diagnostics_dir,
        ):
            return _parameter_server(options)
    assert options.tpu, "options.check: strategy 'tpu' needs options.tpu"
    return _tpu(options.tpu)


@contextlib.contextmanager
def bounded_startup(
    cluster: Cluster | None,
    timeout: float,
    *,
    guard: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    report_to: str | None = None,
) -> Iterator[None]:
    """Bounds the start-up of a cluster task and lets SIGTERM/SIGINT end it at any moment.

    TensorFlow connects to the peers inside one C++ call that holds the GIL
    for as long as a peer is missing (measured: no Python thread and no
    signal handler runs meanwhile, for minutes), and installs a SIGTERM
    handler of its own. So the bound and the signals are handled from
    outside: SIGTERM/SIGINT stay blocked (pending) during the start-up, and
    a watchdog process (`startup_watchdog.py`) kills the task when it sees
    one pending, or at the timeout with one line naming the silent peers.
    TF's own registration timeout ends a task waiting for the leader
    earlier, as a one-line error. Nothing is written before the start-up
    is over but, where it times out and `report_to` (a local directory) is
    given, this task's diagnostics report (`engine.diagnostics`): where each
    thread waited, to `report_to/<task>.txt` (the watchdog has faulthandler
    write the stacks before it kills the task).
    """
    if cluster is None:
        yield
        return
    logger.info(
        "%s:%d connecting to %s (`startup_timeout=%g`s)",
        cluster.task_type,
        cluster.task_index,
        ", ".join(f"{name} at {address}" for name, address in cluster.peers()) or "no peer",
        timeout,
        extra=EVERY_TASK,  # A task waiting for its peers says so, chief or not.
    )
    task = diagnostics.task_name(cluster.task_type, cluster.task_index)
    report = os.path.join(report_to, f"{task}.txt") if report_to and "://" not in report_to else ""
    stacks = tempfile.NamedTemporaryFile("w+", prefix="engine-startup-stacks-", delete=False) if report else None
    if stacks is not None:
        faulthandler.register(STARTUP_STACKS_SIGNAL, file=stacks, all_threads=True)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STARTUP_SIGNALS)
    # The watchdog gives TF's own registration timeout (a clean one-line error) a head start.
    watchdog = subprocess.Popen(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "startup_watchdog.py"),
            str(os.getpid()),
            f"{timeout + WATCHDOG_GRACE_SECONDS if timeout else 0:g}",
            f"{timeout:g}",
            f"{cluster.task_type}:{cluster.task_index}",
            report,  # "": no report.
            stacks.name if stacks is not None else "",
            *(f"{name}={address}" for name, address in cluster.peers()),
        ],
        stdin=subprocess.PIPE,
    )
    try:
        with guard():
            yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
        logger.warning("start-up failed: %s", one_line(error, 500))
        message = _startup_timeout_message(cluster, timeout)
        if report:
            text = diagnostics.report({"phase": "start-up", "ended": message}, task=task)
            with contextlib.suppress(OSError):  # The report must not hide the error.
                message += f"; diagnostics in {diagnostics.write_report(report_to or '', task, text)}"
        raise UserError(message) from None
    finally:
        assert watchdog.stdin is not None, "started with stdin=PIPE"
        watchdog.stdin.close()
        watchdog.wait()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if stacks is not None:
            faulthandler.unregister(STARTUP_STACKS_SIGNAL)
            stacks.close()
            with contextlib.suppress(OSError):
                os.unlink(stacks.name)


def _configure_coordination(cluster: Cluster, timeout: float, heartbeat_timeout: float) -> None:
    """The coordination service MultiWorkerMirroredStrategy would configure, with a
    registration timeout (TF's default, 0, waits forever) and the heartbeat timeout that
    bounds how long a frozen peer goes unnoticed."""
    from engine.compat import configure_coordination_service

    if cluster.task_type not in ("chief", "worker"):
        return
    spec = tf.train.ClusterSpec({job: list(hosts) for job, hosts in cluster.training_spec().items()})
    configure_coordination_service(spec, register_timeout_s=timeout, heartbeat_timeout_s=heartbeat_timeout)


def _startup_timeout_message(cluster: Cluster, timeout: float) -> str:
    peers = cluster.peers()
    silent = [task for task, address in peers if not _answers(address)]
    waited_for = ", ".join(f"{task} ({address})" for task, address in peers if task in silent or not silent)
    return (
        f"{cluster.task_type}:{cluster.task_index} could not reach its peers within "
        f"`startup_timeout={timeout:g}`s; waited for {waited_for}; start every task of the "
        "cluster, check their addresses, or raise `startup_timeout`"
    )


def _answers(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _barrier(strategy: tf.distribute.Strategy) -> None:
    """One all-reduce of a scalar: returns once every worker has joined."""
    per_replica = strategy.run(lambda: tf.constant(1.0))
    strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def _multi_worker_mirrored(options: MultiHostOptions) -> tf.distribute.Strategy:
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[options.communication]
    communication = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation,
        timeout_seconds=options.collective_timeout or None,
    )
    resolver = options.cluster.resolver() if options.cluster is not None else None
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=communication
    )


def _parameter_server(options: MultiHostOptions) -> tf.distribute.Strategy:
    # No variable_partitioner: Keras 3 variables cannot wrap the ShardedVariable
    # it creates (GradientTape fails: 'ShardedVariable' object has no attribute 'handle').
    # Fail RPCs to a dead worker at once so the coordinator reschedules its closures.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    tensorflow_logger = tf.get_logger()
    level = tensorflow_logger.level
    tensorflow_logger.setLevel(logging.WARNING)  # It logs its whole session config at INFO.
    assert options.cluster is not None, "options.check: parameter_server needs a cluster"
    try:
        return tf.distribute.experimental.ParameterServerStrategy(options.cluster.resolver())
    finally:
        tensorflow_logger.setLevel(level)


def _tpu(address: str) -> tf.distribute.Strategy:
    """Connects to and initializes the TPU system; fails at once without one."""
    if address == "local":
        if not tf.config.list_physical_devices("TPU"):
            raise UserError(
                "`tpu='local'` but this machine has no TPU devices; run on a TPU VM, "
                "pass `tpu='grpc://HOST:8470'`, or use another `strategy`"
            )
    else:
        _check_reachable(address)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        detail = one_line(error, 300)
        raise UserError(f"`tpu={address!r}`: cannot connect to the TPU ({detail})") from None


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A TPU worker address must accept a TCP connection; otherwise TF would
    wait for it for minutes."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"grpc://{address}")
    if not parsed.hostname or not parsed.port:
        raise UserError(f"`tpu={address!r}` is neither 'local' nor 'grpc://HOST:PORT'")
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
            pass
    except OSError as error:
        raise UserError(
            f"`tpu={address!r}`: nothing answers at {parsed.hostname}:{parsed.port} "
            f"({error.strerror or error}); check the TPU's address and that it is running"
        ) from None
