"""The multi-host launcher's rendezvous: how the `engine.launch` of every node
learns every training task's address, and how they agree to restart or end.

It exchanges addresses and decisions only; training runs on tf.distribute's
own gRPC runtime. Node 0's launcher serves it at `--rendezvous=HOST:PORT`
(`RendezvousServer`); every node's launcher, node 0's too, is a client
(`RendezvousClient`). The protocol is one JSON object a line over TCP:

    client -> server   join {rank, ports}  beat  failed {cause, status}  stop {cause, status}  done
    server -> client   round {spec, first_index, restarts, lost_s}  beat
                       restart {cause}  end {status, reason}

A round is one cluster: it starts when every expected node has joined, and
ends when every member is done (`end` 0) or one fails (`restart`, or `end`
when no restart is left). A node whose client falls silent for
`heartbeat_timeout` seconds (dead host, partition, frozen launcher) has
failed. After a failure every node leaves and joins again (fresh ports);
the next round waits `rejoin_timeout` seconds for the nodes that failed,
then goes on with those that came back if at least `min_nodes` did. A
node's address is the one its connection comes from (the route that
reaches node 0), unless it names its own. Pure Python: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import selectors
import socket
import threading
import time
from typing import Any

BEAT_SECONDS = 1.0
USER_ERROR_EXIT = 2  # engine.errors.USER_ERROR_EXIT: bad flags fail on every restart alike.


def parse_address(value: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming the value otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (a port from 1 to 65535)")
    return host.strip("[]"), int(port)


def ranks_text(ranks: set[int] | list[int]) -> str:
    return ", ".join(str(rank) for rank in sorted(ranks))


class _Line:
    """One TCP connection's JSON lines: buffered reads, best-effort writes."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""
        self.closed = False
        self.last_heard = time.monotonic()

    def send(self, kind: str, **fields: Any) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall((json.dumps({"kind": kind, **fields}) + "\n").encode())
        except OSError:
            self.close()

    def read(self) -> list[dict[str, Any]]:
        """The complete messages that arrived; marks the line closed at EOF or error."""
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return []
        self.last_heard = time.monotonic()
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        messages = []
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # Not ours (a port scanner): ignored, as a silent line would be.
            if isinstance(message, dict):
                messages.append(message)
        return messages

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


@dataclasses.dataclass
class _Node:
    rank: int
    line: _Line
    host: str
    ports: list[int]


class RendezvousServer:
    """Node 0's side: forms each round's cluster and decides restarts (see the module doc).

    `status` is the run's exit status once the server has ended it, None before.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        nnodes: int,
        min_nodes: int,
        max_restarts: int,
        startup_timeout: float,
        rejoin_timeout: float,
        heartbeat_timeout: float,
    ):
        self.nnodes, self.min_nodes, self.max_restarts = nnodes, min_nodes, max_restarts
        self.startup_timeout, self.rejoin_timeout = startup_timeout, rejoin_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.address_text = f"{address[0]}:{address[1]}"
        self._listener = socket.create_server(address, reuse_port=False)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._lines: dict[socket.socket, _Line] = {}
        self._joined: dict[int, _Node] = {}  # Nodes waiting for the next round.
        self._members: dict[int, _Node] = {}  # The running round's nodes.
        self._done: set[int] = set()
        self._expected = set(range(nnodes))
        self._first_round = True
        self._deadline = time.monotonic() + (startup_timeout or float("inf"))
        self.restarts = 0
        self.lost_s = 0.0
        self._round_started = time.monotonic()
        self.status: int | None = None
        self.reason = ""
        self._ended_at = 0.0
        self._thread = threading.Thread(target=self._serve, name="rendezvous", daemon=True)

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        next_beat = 0.0
        while self.status is None or (time.monotonic() - self._ended_at < 5 and self._lines):
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    line = self._lines[key.fileobj]  # type: ignore[index]
                    for message in line.read():
                        self._on_message(line, message)
                    if line.closed:
                        self._forget(line)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT_SECONDS
                for line in list(self._lines.values()):
                    line.send("beat")
            if self.status is None:
                self._check_silence(now)
                self._check_gathering(now)
        for line in list(self._lines.values()):
            line.close()
        self._selector.close()
        self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._lines[sock] = _Line(sock)
        self._selector.register(sock, selectors.EVENT_READ)

    def _forget(self, line: _Line) -> None:
        self._lines.pop(line.sock, None)
        try:
            self._selector.unregister(line.sock)
        except (KeyError, ValueError):
            pass
        line.close()
        for rank, node in list(self._joined.items()):
            if node.line is line:
                del self._joined[rank]
        member = self._member_of(line)
        if member is not None and self.status is None:
            self._round_failed(f"node {member} left the rendezvous (its launcher ended or its host went down)")

    def _member_of(self, line: _Line) -> int | None:
        return next((rank for rank, node in self._members.items() if node.line is line), None)

    def _on_message(self, line: _Line, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if self.status is not None:
            line.send("end", status=self.status, reason=self.reason)
            return
        if kind == "join":
            self._on_join(line, message)
            return
        rank = self._member_of(line)
        if rank is None:
            return
        if kind == "failed":
            status = int(message.get("status", 1))
            self._round_failed(str(message.get("cause", f"node {rank} failed")), status)
        elif kind == "stop":  # Its launcher was told to stop (Ctrl-C, a scheduler's SIGTERM): all stop.
            self._end(int(message.get("status", 1)), str(message.get("cause", f"node {rank} stopped")))
        elif kind == "done":
            self._done.add(rank)
            if self._done >= set(self._members):
                self._end(0, "every node finished")

    def _on_join(self, line: _Line, message: dict[str, Any]) -> None:
        rank, ports = message.get("rank"), message.get("ports")
        if not isinstance(rank, int) or not 0 <= rank < self.nnodes:
            reason = f"--node_rank={rank} is not below --nnodes={self.nnodes}"
            line.send("end", status=USER_ERROR_EXIT, reason=reason)
            return
        if not isinstance(ports, list) or not all(isinstance(port, int) for port in ports):
            return
        if rank in self._members:  # Its launcher left the round (it failed, or lost us): a failure.
            self._round_failed(f"node {rank} left its round and joined again")
        previous = self._joined.get(rank)
        if previous is not None and previous.line is not line:
            line.send("end", status=USER_ERROR_EXIT, reason=f"two launchers say --node_rank={rank}")
            return
        host = message.get("host") or line.sock.getpeername()[0]
        self._joined[rank] = _Node(rank, line, str(host), ports)

    def _check_silence(self, now: float) -> None:
        if not self.heartbeat_timeout:
            return
        for rank, node in list(self._joined.items()):  # A waiting node gone silent: not in a round.
            if now - node.line.last_heard > self.heartbeat_timeout:
                del self._joined[rank]
                self._forget(node.line)
        for rank, node in list(self._members.items()):
            if now - node.line.last_heard > self.heartbeat_timeout:
                self._round_failed(f"node {rank} stopped answering the rendezvous")
                self._forget(node.line)
                return

    def _check_gathering(self, now: float) -> None:
        if self._members or self.status is not None:
            return
        joined = set(self._joined)
        if joined >= self._expected:
            self._start_round()
            return
        if now < self._deadline:
            return
        missing = self._expected - joined
        if len(joined) >= self.min_nodes and joined:
            self._start_round()
            return
        if self._first_round:
            reason = (
                f"node(s) {ranks_text(missing)} of --nnodes={self.nnodes} never joined the rendezvous at "
                f"{self.address_text} within {self.startup_timeout:g} s (--startup_timeout): start "
                "engine.launch with their --node_rank there, or check that they reach this address"
            )
        else:
            reason = (
                f"node(s) {ranks_text(missing)} did not come back within {self._wait_for_rejoin():g} s "
                f"and {len(joined)} node(s) are fewer than --min_nodes={self.min_nodes}"
            )
        self._end(1, reason)

    def _start_round(self) -> None:
        self._members = dict(sorted(self._joined.items()))
        self._joined = {}
        self._done = set()
        self._first_round = False
        workers: list[str] = []
        first_index: dict[int, int] = {}
        for rank, node in self._members.items():
            first_index[rank] = len(workers)
            workers += [f"{_url_host(node.host)}:{port}" for port in node.ports]
        for rank, node in self._members.items():
            node.line.send(
                "round",
                spec={"worker": workers},
                first_index=first_index[rank],
                nodes=list(self._members),
                restarts=self.restarts,
                lost_s=self.lost_s,
            )
            node.line.last_heard = time.monotonic()

    def _round_failed(self, cause: str, status: int = 1) -> None:
        failed_round = self._members
        if status == USER_ERROR_EXIT or self.restarts >= self.max_restarts:
            self._end(status or 1, cause)
            return
        self.restarts += 1
        now = time.monotonic()
        self.lost_s += now - self._round_started
        self._round_started = now
        for node in failed_round.values():
            node.line.send("restart", cause=cause, restarts=self.restarts, max_restarts=self.max_restarts)
        self._members = {}
        self._expected = set(failed_round) | set(self._joined)
        self._deadline = now + self._wait_for_rejoin()

    def _wait_for_rejoin(self) -> float:
        """How long a next round waits for every node: the rejoin window where the cluster may
        shrink, else the start-up bound."""
        if self.min_nodes < self.nnodes:
            return self.rejoin_timeout
        return self.startup_timeout or float("inf")

    def _end(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason
        self._ended_at = time.monotonic()
        for line in self._lines.values():
            line.send("end", status=status, reason=reason)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class RendezvousClient:
    """A node's side: join, then read what the server decides (see the module doc)."""

    def __init__(self, address: tuple[str, int], *, heartbeat_timeout: float):
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self._line: _Line | None = None
        self._next_beat = 0.0

    @property
    def connected(self) -> bool:
        return self._line is not None and not self._line.closed

    def connect(self, deadline: float) -> bool:
        """Tries until `deadline` (node 0 may start after us); False if it never answered."""
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=2.0)
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)
                continue
            sock.setblocking(False)
            self._line = _Line(sock)
            return True

    def send(self, kind: str, **fields: Any) -> None:
        if self._line is not None:
            self._line.send(kind, **fields)

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """Messages that arrive within `timeout` s (beats answered, not returned); a server
        silent past the heartbeat bound closes the line (`connected` turns False)."""
        line = self._line
        if line is None or line.closed:
            return []
        with selectors.DefaultSelector() as selector:
            selector.register(line.sock, selectors.EVENT_READ)
            ready = selector.select(timeout)
        messages = line.read() if ready else []
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + BEAT_SECONDS
            line.send("beat")
        if self.heartbeat_timeout and now - line.last_heard > self.heartbeat_timeout:
            line.close()
        return [message for message in messages if message.get("kind") != "beat"]

    def close(self) -> None:
        if self._line is not None:
            self._line.close()
