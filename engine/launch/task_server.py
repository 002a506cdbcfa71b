"""`python -m engine.server` (entry point `engine/server.py`): a worker or ps task of a parameter-server cluster.

Such tasks run no training code of their own: the coordinator (the chief,
running `engine.main`) places variables on the ps tasks and sends compiled
functions to the workers. This process only hosts TensorFlow's gRPC server
until it is killed.

    python -m engine.server --task_type=worker --task_index=0 \\
        --chief_host=a:2222 --worker_hosts=b:2222,c:2222 --ps_hosts=d:2222

or with TF_CONFIG set and no cluster flags.
"""

import os
import signal
import sys
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Fail RPCs to a dead peer at once so the coordinator can reschedule its work.
os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

from engine.cli.config import cluster_flags  # noqa: E402  (defines the cluster flags)
from engine.cli.config.flag_names import in_flag_terms  # noqa: E402
from engine.cli.process.preemption import HANDLED_SIGNALS, launcher_pid  # noqa: E402
from engine.cluster import security_warning  # noqa: E402
from engine.errors import USER_ERROR_EXIT, UserError, one_line  # noqa: E402

SERVER_TASK_TYPES = ("worker", "ps")


def serve(wait: Callable[[], None] | None = None) -> None:
    """Starts this task's server and blocks until the process is killed (or `wait` returns)."""
    cluster = cluster_flags.cluster_from_flags()
    if cluster is None:
        raise UserError(
            "engine.server needs a cluster: pass --task_type, --task_index and --worker_hosts, "
            "--ps_hosts, --chief_host, or set TF_CONFIG"
        )
    if cluster.task_type not in SERVER_TASK_TYPES:
        raise UserError(
            f"engine.server runs worker or ps tasks, not {cluster.task_type!r}; "
            "the chief runs `python -m engine.main --strategy=parameter_server`"
        )
    from engine.lean_imports import import_tensorflow_lean

    import_tensorflow_lean()  # As engine.main: Keras's optional libraries unimported, C++ lines held back.
    import tensorflow as tf

    port = int(cluster.address.rpartition(":")[2])
    print(security_warning("engine.server", [port]), file=sys.stderr, flush=True)
    resolver = cluster.resolver()
    try:
        server = tf.distribute.Server(
            resolver.cluster_spec(),
            job_name=cluster.task_type,
            task_index=cluster.task_index,
            protocol="grpc",
            start=True,
        )
    except tf.errors.OpError as error:
        raise UserError(
            f"cannot start the gRPC server of {cluster.task_type}:{cluster.task_index} at "
            f"{cluster.address} ({one_line(error.message)}); is the port in use by another process?"
        ) from None
    print(
        f"engine.server: {cluster.task_type}:{cluster.task_index} serving at {server.target}",
        file=sys.stderr,
        flush=True,
    )
    if wait is None:
        server.join()
    else:
        wait()


def wait_for_the_launcher(launcher: int) -> None:
    """Under engine.launch: the stop signals are taken from the launcher alone, which ends
    this task once the coordinator has saved (it needs this task to save). Others, such as a
    terminal's Ctrl-C that reaches the launcher's whole process group, are named and left to
    it. A signal from the launcher ends the process with 128+signal."""
    while True:
        info = signal.sigwaitinfo(HANDLED_SIGNALS)
        name = signal.Signals(info.si_signo).name
        if info.si_pid == launcher:
            sys.stderr.flush()
            os._exit(128 + info.si_signo)
        print(
            f"engine.server: {name} from pid {info.si_pid} left to engine.launch (pid {launcher}), which "
            "stops this task after the coordinator's save; SIGKILL ends it at once",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"engine.server: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return USER_ERROR_EXIT
    launcher = launcher_pid()
    if launcher is None:
        # join() blocks inside TensorFlow where Python never sees a signal: let
        # Ctrl-C and SIGTERM end the process the plain way.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        wait: Callable[[], None] | None = None
    else:  # Blocked in every thread before TensorFlow starts one, and taken by sigwaitinfo.
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
        wait = lambda: wait_for_the_launcher(launcher)  # noqa: E731
    try:
        serve(wait)
    except UserError as error:
        print(f"engine.server: error: {in_flag_terms(error)}", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0
