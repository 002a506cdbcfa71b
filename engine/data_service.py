"""`python -m engine.data_service`: a tf.data service dispatcher or data worker, for input that outgrows a host.

    python -m engine.data_service --dispatcher --port=5050              # one, anywhere
    python -m engine.data_service --worker --dispatcher_address=HOST:5050   # on each input host
    python -m engine.main --data_service=grpc://HOST:5050 ...            # the run reads from them

The data workers run the run's input pipeline (decoding, augmentation) and
the training process only reads the batches (`engine.DataService`,
docs/several-machines.md "When the input is the bottleneck").
`python -m engine.launch --data_workers=N` starts a dispatcher and N data
workers on its own host instead. Each server prints one line when it serves
(`READY`) and runs until SIGTERM or SIGINT; a worker that cannot reach its
dispatcher within --startup_timeout seconds exits 69 with one line, a port
that cannot be opened exits 2. The servers hold nothing a run needs again:
state is the dispatcher's, and a run started after a dispatcher's restart
starts jobs of its own.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

from engine.cluster import security_warning
from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, PeerLostError, UserError, one_line
from engine.lean_imports import import_tensorflow_lean

PROGRAM = "engine.data_service"
READY = "serving at"  # In the one line each server prints once it serves (engine.launch waits for it).
DEFAULT_STARTUP_TIMEOUT = 60.0


def _host_port(address: str, what: str) -> tuple[str, int]:
    """HOST and PORT of grpc://HOST:PORT or HOST:PORT, or a UserError naming `what`."""
    rest = address.removeprefix("grpc://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"{what}={address} must be HOST:PORT (or grpc://HOST:PORT)")
    return host, int(port)


def wait_for_dispatcher(address: str, timeout: float, *, what: str = "--data_service") -> None:
    """Returns once the dispatcher at `address` accepts a connection; after `timeout` seconds
    (0: forever) raises DispatcherUnreachable in one line. TensorFlow's own client retries an
    unreachable dispatcher without end: a run pointed at a wrong address would hang silently."""
    host, port = _host_port(address, what)
    deadline = None if timeout <= 0 else time.monotonic() + timeout
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as error:
            last = one_line(error)
        if deadline is not None and time.monotonic() >= deadline:
            raise DispatcherUnreachable(
                f"cannot reach the tf.data service dispatcher at {address} within {timeout:g} s ({last}); "
                f"start it there (python -m {PROGRAM} --dispatcher --port={port}) or fix {what}"
            )
        time.sleep(0.2)


class DispatcherUnreachable(PeerLostError):
    """The dispatcher did not answer within the start-up bound: exit 69 (a peer that is not there)."""


def start_dispatcher(port: int) -> Any:
    """A tf.data service dispatcher on `port` (0: one the OS picks), serving."""
    import_tensorflow_lean()  # As engine.main: Keras's optional libraries unimported, C++ lines held back.
    import tensorflow as tf

    config = tf.data.experimental.service.DispatcherConfig(port=port, protocol="grpc")
    try:
        return tf.data.experimental.service.DispatchServer(config, start=True)
    except (tf.errors.OpError, RuntimeError) as error:
        raise UserError(
            f"--port={port}: cannot start the dispatcher ({_message(error)}); is the port in use?"
        ) from None


def start_worker(dispatcher_address: str, port: int, host: str, timeout: float) -> tuple[Any, int]:
    """A data worker on `port` (0: a free one), registered with the dispatcher, serving; and its port.

    The dispatcher is reached first within `timeout` seconds (DispatcherUnreachable after):
    TensorFlow's worker retries its registration without end."""
    wait_for_dispatcher(dispatcher_address, timeout, what="--dispatcher_address")  # Before TF's seconds.
    import_tensorflow_lean()  # As engine.main: Keras's optional libraries unimported, C++ lines held back.
    import tensorflow as tf

    port = port or free_port()  # Chosen here, so that its READY line can name it.
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=dispatcher_address.removeprefix("grpc://"),
        worker_address=f"{host}:%port%",
        port=port,
        protocol="grpc",
    )
    try:
        return tf.data.experimental.service.WorkerServer(config, start=True), port
    except (tf.errors.OpError, RuntimeError) as error:
        raise UserError(
            f"--port={port}: cannot start the data worker ({_message(error)}); is the port in use?"
        ) from None


def free_port() -> int:
    """A port the OS says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _message(error: Exception) -> str:
    return one_line(getattr(error, "message", None) or str(error))


def serve(role: str, *, port: int, dispatcher_address: str | None, host: str, startup_timeout: float) -> Any:
    """Starts the server `role` ("dispatcher" or "worker") and prints its READY line."""
    if role == "dispatcher":
        server = start_dispatcher(port)
        where = server.target
        detail = ""
    else:
        if not dispatcher_address:
            raise UserError(f"--worker needs --dispatcher_address=HOST:PORT (python -m {PROGRAM} --dispatcher)")
        _host_port(dispatcher_address, "--dispatcher_address")
        server, port = start_worker(dispatcher_address, port, host, startup_timeout)
        where = f"{host}:{port}"  # The address it registered with.
        detail = f" for the dispatcher at {dispatcher_address}"
    print(security_warning(PROGRAM, [int(where.rpartition(":")[2])]), file=sys.stderr, flush=True)
    print(f"{PROGRAM}: {role} {READY} {where}{detail}", file=sys.stderr, flush=True)
    return server


def wait_for_stop() -> int:
    """Blocks until SIGTERM, SIGINT or SIGHUP (blocked in every thread before TensorFlow
    started one, so a thread of its own takes it here); returns 128 + the signal."""
    signum = signal.sigwait({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    return 128 + signum


def main(argv: list[str], flag_values: Any) -> int:
    """The program: one server, until a stop signal; the exit status."""
    if len(argv) > 1:
        print(f"{PROGRAM}: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return USER_ERROR_EXIT
    if flag_values.dispatcher == flag_values.worker:
        print(f"{PROGRAM}: error: pass exactly one of --dispatcher, --worker", file=sys.stderr)
        return USER_ERROR_EXIT
    # Before TensorFlow starts a thread: the stop signals then reach only `wait_for_stop`.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    role = "dispatcher" if flag_values.dispatcher else "worker"
    try:
        server = serve(
            role,
            port=flag_values.port,
            dispatcher_address=flag_values.dispatcher_address,
            host=flag_values.host,
            startup_timeout=flag_values.startup_timeout,
        )
    except DispatcherUnreachable as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT
    except UserError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    status = wait_for_stop()
    print(f"{PROGRAM}: {role} stopped by {signal.Signals(status - 128).name}", file=sys.stderr, flush=True)
    del server  # Ends with the process: a server's own stop can wait on a client that is gone.
    sys.stderr.flush()
    os._exit(status)


def define_flags(flag_values: Any) -> None:
    """This program's flags (defined by its `__main__` only: `engine.main` has a --startup_timeout too)."""
    from absl import flags

    flags.DEFINE_boolean("dispatcher", False, "Run the dispatcher.", flag_values=flag_values)
    flags.DEFINE_boolean("worker", False, "Run a data worker.", flag_values=flag_values)
    flags.DEFINE_integer(
        "port", 0, "The port to serve on (0: one the OS picks, printed).", flag_values=flag_values
    )
    flags.DEFINE_string(
        "dispatcher_address", None, "--worker: the dispatcher's HOST:PORT.", flag_values=flag_values
    )
    flags.DEFINE_string(
        "host",
        "localhost",
        "--worker: the host name clients reach this worker at (the dispatcher hands it to them).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "startup_timeout",
        DEFAULT_STARTUP_TIMEOUT,
        "--worker: seconds to reach the dispatcher before exiting 69 with one line; 0 waits forever.",
        flag_values=flag_values,
    )


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, its errors (--port=nan, an unknown flag) one line and exit 2 like every other
    bad input, instead of absl's usage text and exit 1."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        print(f"{PROGRAM}: error: {one_line(error)}; see --help", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    from absl import app, flags

    define_flags(flags.FLAGS)
    app.run(lambda argv: sys.exit(main(argv, flags.FLAGS)), flags_parser=parse_flags)
