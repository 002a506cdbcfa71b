"""A parameter server that stops answering ends the coordinator within a bound, in one line.

The coordinator (the chief) reads and writes the variables on the ps tasks over gRPC. A ps
task that dies drops its connections and TensorFlow's call fails at once; one that is frozen
(SIGSTOP, a stalled host) or cut off keeps them open, and the call waits forever: a checkpoint
save sat 180 s without a line. TensorFlow's coordination service watches no ps task here, so
the chief does: `PsWatch` asks each ps task's own gRPC server for its status (TensorFlow's
`WorkerService/GetStatus`, answered by the server's threads, which a frozen process cannot
run) every quarter of the bound; a task without an answer for `timeout` seconds (the run's
`--heartbeat_timeout`) ends the process with one line naming it and exit 69 (PEER_LOST_EXIT).

The end is `os._exit`: the main thread may be inside a C++ call on that task's variables,
which no exception reaches. Nothing is saved after it; a save under way is left unfinished,
which never becomes the latest checkpoint (the checkpoint state names a save once it is whole).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc  # TensorFlow's own dependency.

from engine.errors import PEER_LOST_EXIT

GET_STATUS = "/tensorflow.WorkerService/GetStatus"
MAX_PROBE_SECONDS = 2.0


def answers(address: str, timeout: float) -> bool:
    """Whether the TensorFlow server at `address` answers a status request within `timeout` s."""
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(GET_STATUS, request_serializer=bytes, response_deserializer=bytes)
        call(b"", timeout=timeout)  # An empty GetStatusRequest.
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def end_process(line: str) -> None:
    """The command's end on a lost ps task: its line, then exit 69 whatever the main thread does."""
    try:
        print(f"engine.main: error: {line}", file=sys.stderr, flush=True)
    finally:
        os._exit(PEER_LOST_EXIT)


class PsWatch:
    """Within `with`: watches the ps tasks `ps` (("ps:0", "host:port"), ...) for `me` (the
    chief, "chief:0"); one silent for `timeout` s calls `end` with the line naming it and
    `kept()` (what stays: it must not wait on a ps task, e.g. the checkpoint state on disk)."""

    def __init__(
        self,
        me: str,
        ps: Sequence[tuple[str, str]],
        *,
        timeout: float,
        kept: Callable[[], str],
        end: Callable[[str], None] = end_process,
    ):
        self.me, self.ps, self.timeout = me, list(ps), timeout
        self.kept, self.end = kept, end
        self.period = max(0.25, timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ps-watch", daemon=True)

    def __enter__(self) -> PsWatch:
        if self.ps:
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=MAX_PROBE_SECONDS * len(self.ps) + 1)

    def _watch(self) -> None:
        heard = {name: time.monotonic() for name, _ in self.ps}
        while not self._stop.wait(self.period):
            for name, address in self.ps:
                if answers(address, min(self.period, MAX_PROBE_SECONDS)):
                    heard[name] = time.monotonic()
            now = time.monotonic()
            silent = [(name, address) for name, address in self.ps if now - heard[name] > self.timeout]
            if silent and not self._stop.is_set():
                self.end(self.line(silent))
                return

    def line(self, silent: Sequence[tuple[str, str]]) -> str:
        names = ", ".join(f"{name} ({address})" for name, address in silent)
        return (
            f"{self.me}: {names} stopped answering (no answer for {self.timeout:g} s): frozen, partitioned "
            f"or dead; {self.kept()}; rerun, or use engine.launch --max_restarts"
        )
