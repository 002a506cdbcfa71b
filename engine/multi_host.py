"""Strategies that span several processes or machines: MultiWorkerMirrored,
ParameterServer and TPU, built on tf.distribute's own gRPC runtime.

`engine.strategy.build_strategy` calls `build_multi_host_strategy`; the
cluster itself is resolved (and checked) by `engine.cluster`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import urllib.parse

import tensorflow as tf
from absl import logging

from engine.cluster import Cluster, check_strategy_cluster
from engine.errors import UserError

COMMUNICATIONS = ("auto", "ring", "nccl")
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class MultiHostOptions:
    """How a multi-host strategy talks to its cluster."""

    cluster: Cluster | None = None
    communication: str = "auto"
    # Seconds a collective may wait for its peers: a dead worker then ends
    # the run with an error instead of hanging it. 0 waits forever.
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    tpu: str | None = None

    def check(self, strategy: str) -> None:
        if self.communication not in COMMUNICATIONS:
            raise UserError(
                f"unknown --communication={self.communication!r}; choose one of: {', '.join(COMMUNICATIONS)}"
            )
        if self.collective_timeout < 0:
            raise UserError(f"--collective_timeout={self.collective_timeout} must be >= 0 (0: no timeout)")
        if strategy == "tpu" and not self.tpu:
            raise UserError("--strategy=tpu needs --tpu=local (a TPU VM) or --tpu=grpc://HOST:PORT")
        if self.tpu and strategy != "tpu":
            raise UserError(f"--tpu={self.tpu} needs --strategy=tpu")
        check_strategy_cluster(strategy, self.cluster)


def build_multi_host_strategy(name: str, options: MultiHostOptions) -> tf.distribute.Strategy:
    options.check(name)
    if name == "multi_worker_mirrored":
        return _multi_worker_mirrored(options)
    if name == "parameter_server":
        return _parameter_server(options)
    return _tpu(options.tpu)


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
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)  # It logs its whole session config at INFO.
    try:
        return tf.distribute.experimental.ParameterServerStrategy(
            options.cluster.resolver()
        )
    finally:
        logging.set_verbosity(verbosity)


def _tpu(address: str) -> tf.distribute.Strategy:
    """Connects to and initializes the TPU system; fails at once without one."""
    if address == "local":
        if not tf.config.list_physical_devices("TPU"):
            raise UserError(
                "--tpu=local but this machine has no TPU devices; run on a TPU VM, "
                "pass --tpu=grpc://HOST:8470, or use another --strategy"
            )
    else:
        _check_reachable(address)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"--tpu={address}: cannot connect to the TPU ({detail})") from None


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A TPU worker address must accept a TCP connection; otherwise TF would
    wait for it for minutes."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"grpc://{address}")
    if not parsed.hostname or not parsed.port:
        raise UserError(f"--tpu={address} is neither `local` nor grpc://HOST:PORT")
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
            pass
    except OSError as error:
        raise UserError(
            f"--tpu={address}: nothing answers at {parsed.hostname}:{parsed.port} ({error.strerror or error}); "
            "check the TPU's address and that it is running"
        ) from None
