"""Node 0's side of the rendezvous: it admits the run's nodes, forms each round's cluster and
decides restarts.

Who gets in: a bad frame, a failed proof, a message off its schema or a handshake not
finished within `HANDSHAKE_SECONDS` drops that connection with one warning line; the
server itself never stops on what a connection sends. A failed proof is answered
`rejected` first, which tells no more than the close would: the node then ends at once
(exit 2, another secret) instead of retrying. Node 0 waits on, so that a stranger's
proof never ends a run, and ends with 2 only if a node never came. Connections in their
handshake hold slots, at most `MAX_UNPROVEN_PER_ADDRESS` per address and `MAX_UNPROVEN`
in all: a new one evicts the oldest of its own address, or of the address holding the
most, so that idle sockets at one address never keep a node at another out.

A round is one cluster: it starts when every expected node has joined, and ends when
every member is done (`end` 0) or one fails (`restart`, or `end` when no restart is
left). A join whose settings differ from node 0's ends the run on every node (exit 2)
naming the flags. A node whose client falls silent for `heartbeat_timeout` seconds
(dead host, partition, frozen launcher) has failed. After a failure every node leaves
and joins again (fresh ports); the next round waits `rejoin_timeout` seconds for the
nodes that failed, then goes on with those that came back if at least `min_nodes` did.
A node's address is the one its connection comes from (the route that reaches node 0),
unless it names its own.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, final_status
from engine.launch.rendezvous.protocol import (
    BEAT_SECONDS,
    HANDSHAKE_SECONDS,
    NONCE_BYTES,
    PROTOCOL,
    Channel,
    ProtocolError,
    check_from_node,
    mac,
    nonce_of,
    settings_difference,
    settings_digest,
)
from engine.launch.rendezvous.secret import SECRET_ENV, SECRET_FLAG

# Connections still in their handshake, from all addresses and from one (an IPv6 /64): a new one
# past either cap evicts the oldest of its address, or of the address that holds the most, so
# that strangers at one address, however many sockets they hold, never keep out a node at another.
MAX_UNPROVEN = 64
MAX_UNPROVEN_PER_ADDRESS = 8
MAX_ACCEPTS_PER_WAKE = 64  # Connections taken from the listen queue before the others are served.
_WARNINGS_PER_WINDOW, _WARNING_WINDOW_SECONDS = 5, 10.0


def ranks_text(ranks: set[int] | list[int]) -> str:
    """Node ranks as a line names them: "1, 2, 5"."""
    return ", ".join(str(rank) for rank in sorted(ranks))


@dataclasses.dataclass(eq=False)
class _Conn:
    """A connection to the server: its channel, who it comes from, how far its handshake is."""

    channel: Channel
    peer: str
    opened: float
    stage: str = "hello"  # hello -> proof -> ready
    nonces: bytes = b""

    @property
    def source(self) -> str:
        return source_of(self.peer)


def source_of(peer: str) -> str:
    """The address whose connections share handshake slots: an IPv4 address, an IPv6 /64 (what
    one host is usually given, so that a stranger cannot take a slot per address of its own)."""
    try:
        address = ipaddress.ip_address(peer.split("%")[0])
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclasses.dataclass
class _Node:
    rank: int
    conn: _Conn
    host: str
    ports: list[int]


class _Warnings:
    """One line per dropped connection, at most a few per window, so that a flood of strangers
    cannot bury the run's own lines; the ones left out are counted in the next."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self.window_start = 0.0
        self.in_window = 0
        self.left_out = 0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now - self.window_start > _WARNING_WINDOW_SECONDS:
            self.window_start, self.in_window = now, 0
        if self.in_window >= _WARNINGS_PER_WINDOW:
            self.left_out += 1
            return
        self.in_window += 1
        if self.left_out:
            line += f" ({self.left_out} more dropped since the last warning)"
            self.left_out = 0
        self.warn(line)


class RendezvousServer:
    """Node 0's side: admits the run's nodes, forms each round's cluster and decides restarts
    (see the module doc).

    `status` is the run's exit status once the server has ended it, None before. `settings`
    are node 0's run settings, which every joining node's must equal; `warn` takes the one
    line of each connection dropped.
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
        workers_per_node: int = 1,
        secret: bytes | None = None,
        settings: Mapping[str, str | None] | None = None,
        warn: Callable[[str], None] = lambda line: None,
    ):
        self.nnodes, self.min_nodes, self.max_restarts = nnodes, min_nodes, max_restarts
        self.startup_timeout, self.rejoin_timeout = startup_timeout, rejoin_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.workers_per_node = workers_per_node
        self._secret = secret or b""
        self.settings = dict(settings or {})
        self._digest = settings_digest(self.settings)
        self._warn = _Warnings(warn)
        self.address_text = f"{address[0]}:{address[1]}"
        self._listener = socket.create_server(address, reuse_port=False)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
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
        self.dropped = 0  # Connections dropped for what they sent (or did not send).
        self._unproven_hosts: set[str] = set()  # Hosts whose connections failed the handshake.
        self._wrong_secret_hosts: set[str] = set()  # Hosts whose proof was of another secret.
        self._thread = threading.Thread(target=self._serve, name="rendezvous", daemon=True)

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        next_beat = 0.0
        while self.status is None or (time.monotonic() - self._ended_at < 5 and self._conns):
            try:
                next_beat = self._serve_once(next_beat)
            except Exception as error:  # A bug here must not leave every node waiting for a dead server.
                self._warn(f"warning: the rendezvous recovered from {type(error).__name__}: {error}")
                time.sleep(0.2)
        for conn in list(self._conns.values()):
            conn.channel.close()
        self._selector.close()
        self._listener.close()

    def _serve_once(self, next_beat: float) -> float:
        for key, _ in self._selector.select(timeout=0.2):
            if key.fileobj is self._listener:
                self._accept()
                continue
            conn = self._conns.get(key.fileobj)  # type: ignore[call-overload]
            if conn is None:
                continue
            try:
                conn.channel.fill()
                while not conn.channel.closed:  # One at a time: a handshake changes how the next opens.
                    messages = conn.channel.take(1)
                    if not messages:
                        break
                    self._on_frame(conn, messages[0])
            except ProtocolError as error:
                self._drop(conn, str(error))
                continue
            if conn.channel.closed:
                self._forget(conn)
        now = time.monotonic()
        self._check_handshakes(now)
        if now >= next_beat:
            next_beat = now + BEAT_SECONDS
            for conn in list(self._conns.values()):
                if conn.stage == "ready":
                    conn.channel.send("beat")
        if self.status is None:
            self._check_silence(now)
            self._check_gathering(now)
        return next_beat

    def _accept(self) -> None:
        for _ in range(MAX_ACCEPTS_PER_WAKE):
            try:
                sock, peer = self._listener.accept()
            except OSError:  # BlockingIOError: the queue is empty.
                return
            conn = _Conn(Channel(sock), str(peer[0]), time.monotonic())
            self._make_room(conn.source)
            sock.setblocking(False)
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _make_room(self, source: str) -> None:
        """Frees a handshake slot for a connection from `source` where a cap is reached: the
        oldest unproven one of `source`, or of the address holding the most. A flood then only
        ever evicts its own; a node with the secret proves it in milliseconds, and retries."""
        unproven = [conn for conn in self._conns.values() if conn.stage != "ready"]
        mine = [conn for conn in unproven if conn.source == source]
        if len(mine) >= MAX_UNPROVEN_PER_ADDRESS:
            why = f"{len(mine)} connections from {source} are in their handshake"
        elif len(unproven) >= MAX_UNPROVEN:
            counts: dict[str, int] = {}
            for conn in unproven:
                counts[conn.source] = counts.get(conn.source, 0) + 1
            busiest = max(counts, key=lambda address: counts[address])
            mine = [conn for conn in unproven if conn.source == busiest]
            why = f"{len(unproven)} connections are in their handshake, {len(mine)} of them from {busiest}"
        else:
            return
        oldest = min(mine, key=lambda conn: conn.opened)
        self._warn(f"warning: dropped a connection from {oldest.peer}: {why} (the oldest goes)")
        self._forget(oldest)
        self.dropped += 1

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.stage != "ready":
            self._unproven_hosts.add(conn.peer)
        self._warn(f"warning: dropped a connection from {conn.peer}: {why}")
        self._forget(conn)
        self.dropped += 1  # Counted once done: a reader of the count (a test) finds the node gone too.

    def _forget(self, conn: _Conn) -> None:
        self._conns.pop(conn.channel.sock, None)
        try:
            self._selector.unregister(conn.channel.sock)
        except (KeyError, ValueError):
            pass
        conn.channel.close()
        for rank, node in list(self._joined.items()):
            if node.conn is conn:
                del self._joined[rank]
        member = self._member_of(conn)
        if member is not None and self.status is None:
            self._round_failed(
                f"node {member} left the rendezvous (its launcher ended or its host went down)", PEER_LOST_EXIT
            )

    def _check_handshakes(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.stage != "ready" and now - conn.opened > HANDSHAKE_SECONDS:
                self._drop(conn, f"it did not prove it holds the run's secret within {HANDSHAKE_SECONDS:g} s")

    def _on_frame(self, conn: _Conn, message: dict[str, Any]) -> None:
        if conn.stage == "hello":
            if message.get("kind") != "hello" or message.get("protocol") != PROTOCOL:
                raise ProtocolError(
                    f"its first message is not a {PROTOCOL} hello (another program, or an older engine)"
                )
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            conn.nonces = nonce_of(message) + server_nonce
            conn.stage = "proof"
            conn.channel.send("challenge", nonce=server_nonce.hex())
        elif conn.stage == "proof":
            proof = nonce_of(message, "proof") if message.get("kind") == "proof" else b""
            if not hmac.compare_digest(proof, mac(self._secret, b"client", conn.nonces)):
                if message.get("kind") == "proof":  # A node of another run, or one given another secret.
                    self._wrong_secret_hosts.add(conn.peer)
                    conn.channel.send("rejected")  # Says no more than closing would; the node stops trying.
                raise ProtocolError(f"it did not prove it holds the run's secret ({SECRET_ENV} / {SECRET_FLAG})")
            conn.channel.send("welcome", proof=mac(self._secret, b"server", conn.nonces).hex())
            conn.channel.secure(
                mac(self._secret, b"server to node", conn.nonces),
                mac(self._secret, b"node to server", conn.nonces),
            )
            conn.stage = "ready"
        else:
            check_from_node(message, workers_per_node=self.workers_per_node)
            self._on_message(conn, message)

    def _member_of(self, conn: _Conn) -> int | None:
        return next((rank for rank, node in self._members.items() if node.conn is conn), None)

    def _on_message(self, conn: _Conn, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if self.status is not None:
            if kind != "beat":
                conn.channel.send("end", status=self.status, reason=self.reason)
            return
        if kind == "join":
            self._on_join(conn, message)
            return
        rank = self._member_of(conn)
        if kind == "stop" and rank is None:  # A node stopped while it waited for its round: all stop.
            rank = next((joined for joined, node in self._joined.items() if node.conn is conn), None)
        if rank is None:
            return
        if kind == "failed":
            self._round_failed(message["cause"] or f"node {rank} failed", message["status"])
        elif kind == "stop":  # Its launcher was told to stop (Ctrl-C, a scheduler's SIGTERM): all stop.
            self._end(message["status"], message["cause"] or f"node {rank} stopped")
        elif kind == "done":
            self._done.add(rank)
            if self._done >= set(self._members):
                self._end(0, "every node finished")

    def _on_join(self, conn: _Conn, message: dict[str, Any]) -> None:
        rank, ports = message["rank"], message["ports"]
        if not rank < self.nnodes:
            reason = f"--node_rank={rank} is not below --nnodes={self.nnodes}"
            conn.channel.send("end", status=USER_ERROR_EXIT, reason=reason)
            return
        if message["digest"] != self._digest:
            difference = settings_difference(rank, message["settings"], self.settings)
            self._end(USER_ERROR_EXIT, difference or f"node {rank}'s settings differ from node 0's")
            return
        if rank in self._members:  # Its launcher left the round (it failed, or lost us): a failure.
            self._round_failed(f"node {rank} left its round and joined again", PEER_LOST_EXIT)
        previous = self._joined.get(rank)
        if previous is not None and previous.conn is not conn:
            conn.channel.send("end", status=USER_ERROR_EXIT, reason=f"two launchers say --node_rank={rank}")
            return
        host = message.get("host") or conn.peer
        self._joined[rank] = _Node(rank, conn, str(host), list(ports))

    def _check_silence(self, now: float) -> None:
        if not self.heartbeat_timeout:
            return
        for rank, node in list(self._joined.items()):  # A waiting node gone silent: not in a round.
            if now - node.conn.channel.last_heard > self.heartbeat_timeout:
                del self._joined[rank]
                self._forget(node.conn)
        for rank, node in list(self._members.items()):
            if now - node.conn.channel.last_heard > self.heartbeat_timeout:
                self._round_failed(f"node {rank} stopped answering the rendezvous", PEER_LOST_EXIT)
                self._forget(node.conn)
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
            self._end(*self._never_joined(missing))
            return
        reason = (
            f"node(s) {ranks_text(missing)} did not come back within {self._wait_for_rejoin():g} s "
            f"and {len(joined)} node(s) are fewer than --min_nodes={self.min_nodes}"
        )
        self._end(PEER_LOST_EXIT, reason)  # Peers unavailable, as one lost mid-run: a rerun may see them.

    def _never_joined(self, missing: set[int]) -> tuple[int, str]:
        """The status and line of a start-up that ended without `missing`: peers unavailable
        (69, a rerun may see them), or 2 where a node offered a proof of another secret. That
        node was told at once and exits 2 itself; node 0 waits on, so that a stranger's wrong
        proof never ends a run whose nodes all come, and says so only once they did not."""
        reason = (
            f"node(s) {ranks_text(missing)} of --nnodes={self.nnodes} never joined the rendezvous at "
            f"{self.address_text} within {self.startup_timeout:g} s (--startup_timeout)"
        )
        if self._wrong_secret_hosts:
            hosts = ", ".join(sorted(self._wrong_secret_hosts)[:5])
            return USER_ERROR_EXIT, (
                f"{reason}, and node 0 refused a node at {hosts} whose secret is another: give every node "
                f"the same {SECRET_ENV} or {SECRET_FLAG}"
            )
        reason += ": start engine.launch with their --node_rank there, or check that they reach this address"
        if self._unproven_hosts:
            hosts = ", ".join(sorted(self._unproven_hosts)[:5])
            reason += f"; connections from {hosts} did not finish the handshake (another program, or a stranger)"
        return PEER_LOST_EXIT, reason

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
            node.conn.channel.send(
                "round",
                spec={"worker": workers},
                first_index=first_index[rank],
                nodes=list(self._members),
                restarts=self.restarts,
                lost_s=self.lost_s,
            )
            node.conn.channel.last_heard = time.monotonic()

    def _round_failed(self, cause: str, status: int) -> None:
        """Restarts the round on `status` (the failed task's, or 69 for a node the rendezvous
        lost), or ends the run with it once no restart is left (docs/several-machines.md)."""
        failed_round = self._members
        if status == USER_ERROR_EXIT or self.restarts >= self.max_restarts:
            self._end(*final_status(status, cause, restarts=self.max_restarts, flag="--max_restarts"))
            return
        self.restarts += 1
        now = time.monotonic()
        self.lost_s += now - self._round_started
        self._round_started = now
        for node in failed_round.values():
            node.conn.channel.send(
                "restart", cause=cause, restarts=self.restarts, max_restarts=self.max_restarts
            )
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
        for conn in self._conns.values():
            if conn.stage == "ready":
                conn.channel.send("end", status=status, reason=reason)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
