"""The multi-host launcher's rendezvous: how the `engine.launch` of every node
learns every training task's address, and how they agree to restart or end.

It exchanges addresses and decisions only; training runs on tf.distribute's
own gRPC runtime. Node 0's launcher serves it at `--rendezvous=HOST:PORT`
(`RendezvousServer`); every node's launcher, node 0's too, is a client
(`RendezvousClient`).

Who may talk: the run's nodes share a secret (`SECRET_ENV` or a file; required
off loopback, `secret_problem`). A connection first proves it in both
directions without sending it (HMAC-SHA256 over two fresh nonces: the node
proves itself first, so the always-listening server gives a stranger nothing to
work on; then the server proves itself, so a fake node 0 cannot steer a node
either), and both sides derive one session key per direction from it. Every
later message carries an HMAC of its body and its sequence number under that
key: nothing can be injected, changed, replayed or reordered. Without the
secret nothing a connection sends reaches the run.

Wire format: frames of a 4-byte big-endian length and that many bytes, at most
`HANDSHAKE_FRAME_BYTES` before the handshake and `MAX_FRAME_BYTES` after (a
longer frame drops the connection before it is read); a frame's body is one JSON
object, checked against its message's schema (`check_from_node`,
`check_from_server`) before anything uses it. The handshake:

    node -> server   hello {protocol, nonce}
    server -> node   challenge {nonce}
    node -> server   proof {proof}              HMAC(secret, "client" nonces)
    server -> node   welcome {proof}            HMAC(secret, "server" nonces)
                     or rejected {}             the node's proof is not of node 0's secret

and then, authenticated:

    node -> server   join {rank, ports, host, settings, digest}  beat  failed {cause, status}
                     stop {cause, status}  done
    server -> node   round {spec, first_index, nodes, restarts, lost_s}  beat
                     restart {cause, restarts, max_restarts}  end {status, reason}

A bad frame, a failed proof, a message off its schema or a handshake not
finished within `HANDSHAKE_SECONDS` drops that connection with one warning
line; the server itself never stops on what a connection sends. A failed
proof is answered `rejected` first, which tells no more than the close would:
the node then ends at once (exit 2, another secret) instead of retrying. Node 0
waits on, so that a stranger's proof never ends a run, and ends with 2 only
if a node never came. Connections in their handshake hold slots, at most
`MAX_UNPROVEN_PER_ADDRESS` per address and `MAX_UNPROVEN` in all: a new one
evicts the oldest of its own address, or of the address holding the most, so
that idle sockets at one address never keep a node at another out.

A round is one cluster: it starts when every expected node has joined, and
ends when every member is done (`end` 0) or one fails (`restart`, or `end`
when no restart is left). A join carries the node's run settings (the flags
that must be equal everywhere) and their digest: one that differs from node
0's ends the run on every node (exit 2) naming the flags. A node whose client
falls silent for `heartbeat_timeout` seconds (dead host, partition, frozen
launcher) has failed. After a failure every node leaves and joins again
(fresh ports); the next round waits `rejoin_timeout` seconds for the nodes
that failed, then goes on with those that came back if at least `min_nodes`
did. A node's address is the one its connection comes from (the route that
reaches node 0), unless it names its own. Pure Python: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import math
import os
import re
import secrets
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT, final_status

BEAT_SECONDS = 1.0
PROTOCOL = "engine-rendezvous-2"
SECRET_ENV = "ENGINE_RENDEZVOUS_SECRET"
SECRET_FLAG = "--rendezvous_secret_file"
MIN_SECRET_BYTES = 16  # A shorter secret could be guessed offline from one recorded handshake.
MAX_SECRET_FILE_BYTES = 4096
HANDSHAKE_FRAME_BYTES = 512
MAX_FRAME_BYTES = 1 << 20  # A round of ~40,000 workers' addresses; TF_CONFIG itself stops far below.
# A connection that has not proved the secret by then is dropped: a node proves it in two round
# trips (milliseconds, a second on a slow link), an idle stranger holds a slot no longer.
HANDSHAKE_SECONDS = 5.0
# Connections still in their handshake, from all addresses and from one (an IPv6 /64): a new one
# past either cap evicts the oldest of its address, or of the address that holds the most, so
# that strangers at one address, however many sockets they hold, never keep out a node at another.
MAX_UNPROVEN = 64
MAX_UNPROVEN_PER_ADDRESS = 8
MAX_ACCEPTS_PER_WAKE = 64  # Connections taken from the listen queue before the others are served.
MAX_PORTS = 1024  # engine.launch.task_processes.MAX_TASKS: the tasks one node starts.
MAX_TEXT = 2000  # A cause, a reason, an address: longer text is not ours.
MAX_SETTINGS = 512
MAX_SETTING_TEXT = 4096
LAUNCH_SETTING = "engine.launch "  # The prefix of the launcher's own settings among a node's.
_MAC_BYTES = hashlib.sha256().digest_size
_NONCE_BYTES = 32
_HOST = re.compile(r"^[A-Za-z0-9._:%\-\[\]]{1,253}$")  # A host name or an IP literal, nothing more.
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_WARNINGS_PER_WINDOW, _WARNING_WINDOW_SECONDS = 5, 10.0


def parse_address(value: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming the value otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (a port from 1 to 65535)")
    return host.strip("[]"), int(port)


def ranks_text(ranks: set[int] | list[int]) -> str:
    return ", ".join(str(rank) for rank in sorted(ranks))


# ------------------------------------------------------------------------------ the secret


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback (127.0.0.0/8, ::1): only
    then may the rendezvous go without a secret, reachable from this machine alone."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(
            ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
        )
    except ValueError:
        return False


def read_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The run's secret: the file `path` names (`--rendezvous_secret_file`) or else `SECRET_ENV`;
    None when neither is given. ValueError, one line naming the source and the fix, for a file
    that is not a small regular file, one that users other than its owner may read or write,
    or a secret too short to resist guessing."""
    if path is not None:
        where = f"{SECRET_FLAG}={path}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # A FIFO must not block the launcher.
        except OSError as error:
            raise ValueError(f"{where}: cannot read it ({error.strerror or error})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SECRET_FILE_BYTES:
                raise ValueError(
                    f"{where} must be a regular file of at most {MAX_SECRET_FILE_BYTES} bytes holding the secret"
                )
            if info.st_mode & 0o077:  # As ssh refuses a private key others may read.
                raise ValueError(
                    f"{where} may be read or written by other users (mode {stat.S_IMODE(info.st_mode):04o}), "
                    f"and whoever reads the secret can join and steer the run: `chmod 600 {path}`"
                )
            raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
        finally:
            os.close(fd)
        secret = raw.strip()
    elif SECRET_ENV in environ:
        where = f"{SECRET_ENV}"
        secret = environ[SECRET_ENV].strip().encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where} holds a secret of {len(secret)} byte(s); use at least {MIN_SECRET_BYTES} random ones, "
            "the same on every node, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return secret


def valid_host(host: str) -> bool:
    """Whether `host` can stand in a HOST:PORT address: a name or an IP literal, nothing more."""
    return bool(_HOST.match(host))


def secret_problem(host: str, secret: bytes | None) -> str | None:
    """Why the rendezvous at `host` may not run as given: off loopback it needs the secret."""
    if secret is not None or is_loopback(host):
        return None
    return (
        f"the rendezvous at {host} is reachable from other machines, so the run's nodes must share a "
        f"secret: export {SECRET_ENV} or pass {SECRET_FLAG}=FILE (a file only this user reads) with the "
        "same random value on every node, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
    )


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, PROTOCOL.encode() + b" " + label + b"".join(parts), hashlib.sha256).digest()


# ------------------------------------------------------------------------------ settings


def settings_digest(settings: Mapping[str, str | None]) -> str:
    """The digest a node sends of its run settings (canonical JSON, SHA-256)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings_difference(
    rank: int, theirs: Mapping[str, str | None], ours: Mapping[str, str | None]
) -> str | None:
    """The one line that ends a run whose node `rank` was given other settings than node 0, or None."""
    names = [name for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]
    if not names:
        return None
    shown = names[:6]
    more = f" (and {len(names) - len(shown)} more)" if len(names) > len(shown) else ""

    def spelled(values: Mapping[str, str | None]) -> str:
        flags = []
        for name in shown:
            flag = "--" + name.removeprefix(LAUNCH_SETTING)
            value = values.get(name)
            flags.append(f"{flag} unset" if value is None else f"{flag}={value[:200]}")
        return ", ".join(flags)

    verb = "differs" if len(names) == 1 else "differ"
    if any(name.startswith(LAUNCH_SETTING) for name in names):
        fix = "run the same engine.launch command on every node, changing only --node_rank"
    else:
        fix = "give every node the same flags after --"
    return f"node {rank}'s {spelled(theirs)}{more} {verb} from node 0's {spelled(ours)}; {fix}"


# ------------------------------------------------------------------------------ messages


class ProtocolError(Exception):
    """What a connection sent is not this protocol's (too long, unauthenticated, off its schema)."""


def _integer(message: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(
            f"{message.get('kind')}.{name}={_shown(value)} is not an integer from {low} to {high}"
        )
    return value


def _text(message: Mapping[str, Any], name: str, limit: int = MAX_TEXT) -> str:
    value = message.get(name)
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(
            f"{message.get('kind')}.{name}={_shown(value)} is not a text of at most {limit} characters"
        )
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_settings(message: Mapping[str, Any]) -> None:
    settings, digest = message.get("settings"), message.get("digest")
    if (
        not isinstance(settings, dict)
        or len(settings) > MAX_SETTINGS
        or not all(isinstance(name, str) and len(name) <= 200 for name in settings)
        or not all(
            value is None or (isinstance(value, str) and len(value) <= MAX_SETTING_TEXT)
            for value in settings.values()
        )
    ):
        raise ProtocolError(f"join.settings is not a mapping of at most {MAX_SETTINGS} flags to texts")
    if not isinstance(digest, str) or digest != settings_digest(settings):
        raise ProtocolError("join.digest is not the digest of join.settings")


def check_from_node(message: Mapping[str, Any], *, workers_per_node: int) -> None:
    """ProtocolError unless `message` is a node's message as the protocol defines it. A join's
    rank is checked against --nnodes by the server itself (a user's mistake, answered with `end`)."""
    kind = message.get("kind")
    if kind == "join":
        _integer(message, "rank", 0, 1 << 20)
        ports = message.get("ports")
        if (
            not isinstance(ports, list)
            or len(ports) != workers_per_node
            or not all(
                isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 for port in ports
            )
        ):
            raise ProtocolError(f"join.ports={_shown(ports)} is not {workers_per_node} port(s) from 1 to 65535")
        host = message.get("host")
        if host is not None and (not isinstance(host, str) or not valid_host(host)):
            raise ProtocolError(f"join.host={_shown(host)} is not a host name or address")
        _check_settings(message)
    elif kind in ("failed", "stop"):
        _integer(message, "status", 1, 255)
        _text(message, "cause")
    elif kind not in ("beat", "done"):
        raise ProtocolError(f"{_shown(kind)} is not a message a node sends")


def check_from_server(message: Mapping[str, Any], *, workers_per_node: int) -> None:
    """ProtocolError unless `message` is the server's message as the protocol defines it."""
    kind = message.get("kind")
    if kind == "round":
        spec = message.get("spec")
        workers = spec.get("worker") if isinstance(spec, dict) else None
        if (
            not isinstance(spec, dict)
            or set(spec) != {"worker"}
            or not isinstance(workers, list)
            or not 0 < len(workers) <= MAX_FRAME_BYTES // 8
        ):
            raise ProtocolError("round.spec is not {'worker': [HOST:PORT, ...]}")
        for address in workers:
            if not isinstance(address, str) or not _HOST.match(address.rpartition(":")[0] or "-"):
                raise ProtocolError(f"round.spec has {_shown(address)}, not HOST:PORT")
            try:
                parse_address(address)
            except ValueError as error:
                raise ProtocolError(f"round.spec: {error}") from None
        _integer(message, "first_index", 0, len(workers) - workers_per_node)
        nodes = message.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(node, int) for node in nodes):
            raise ProtocolError("round.nodes is not a list of node ranks")
        _integer(message, "restarts", 0, 2**31 - 1)
        lost = message.get("lost_s")
        if (
            isinstance(lost, bool)
            or not isinstance(lost, (int, float))
            or not (math.isfinite(lost) and lost >= 0)
        ):
            raise ProtocolError(f"round.lost_s={_shown(lost)} is not a duration")
    elif kind == "restart":
        _text(message, "cause")
        _integer(message, "restarts", 1, 2**31 - 1)
        _integer(message, "max_restarts", 1, 2**31 - 1)
    elif kind == "end":
        _integer(message, "status", 0, 255)
        _text(message, "reason")
    elif kind != "beat":
        raise ProtocolError(f"{_shown(kind)} is not a message the rendezvous sends")


class _Channel:
    """One TCP connection's frames: bounded reads, and after the handshake an HMAC and a
    sequence number on every frame each way (`secure`)."""

    def __init__(self, sock: socket.socket, limit: int = HANDSHAKE_FRAME_BYTES):
        self.sock = sock
        self.limit = limit
        self.buffer = bytearray()
        self.closed = False
        self.last_heard = time.monotonic()
        self._send_key: bytes | None = None
        self._receive_key: bytes | None = None
        self._sent = 0
        self._received = 0

    def secure(self, send_key: bytes, receive_key: bytes) -> None:
        self._send_key, self._receive_key = send_key, receive_key
        self.limit = MAX_FRAME_BYTES

    def send(self, kind: str, **fields: Any) -> None:
        """Best effort: a connection that cannot take a frame now (closed, full) is closed."""
        if self.closed:
            return
        body = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
        if self._send_key is not None:
            body = _mac(self._send_key, b"message", self._sent.to_bytes(8, "big"), body) + body
            self._sent += 1
        try:
            self.sock.sendall(len(body).to_bytes(4, "big") + body)
        except OSError:
            self.close()

    def fill(self) -> None:
        """Reads what arrived into the buffer (non-blocking); marks the channel closed at EOF."""
        try:
            chunk = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self.buffer += chunk

    def take(self, most: int | None = None) -> list[dict[str, Any]]:
        """Up to `most` complete messages from the buffer, opened (the rest stay buffered: the
        frames after a handshake's last one are under keys not set yet). ProtocolError for a
        frame over the limit, a wrong HMAC or a body that is not a message object."""
        messages: list[dict[str, Any]] = []
        while len(self.buffer) >= 4 and (most is None or len(messages) < most):
            size = int.from_bytes(self.buffer[:4], "big")
            if size > self.limit:
                raise ProtocolError(f"a frame of {size} bytes, over this stage's limit of {self.limit}")
            if len(self.buffer) < 4 + size:
                break
            frame = bytes(self.buffer[4 : 4 + size])
            del self.buffer[: 4 + size]
            messages.append(self._open(frame))
        return messages

    def _open(self, frame: bytes) -> dict[str, Any]:
        if self._receive_key is not None:
            tag, frame = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
            expected = _mac(self._receive_key, b"message", self._received.to_bytes(8, "big"), frame)
            if not hmac.compare_digest(tag, expected):
                raise ProtocolError("a message whose HMAC is wrong (forged, changed, replayed or out of order)")
            self._received += 1
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):
            raise ProtocolError("a frame that is not JSON") from None
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            raise ProtocolError("a frame that is not a message object")
        self.last_heard = time.monotonic()
        return message

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def _nonce(message: Mapping[str, Any], name: str = "nonce") -> bytes:
    value = message.get(name)
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ProtocolError(f"{message.get('kind')}.{name} is not 64 hex digits")
    return bytes.fromhex(value)


# ------------------------------------------------------------------------------ the server


@dataclasses.dataclass(eq=False)
class _Conn:
    """A connection to the server: its channel, who it comes from, how far its handshake is."""

    channel: _Channel
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
            conn = _Conn(_Channel(sock), str(peer[0]), time.monotonic())
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
            server_nonce = secrets.token_bytes(_NONCE_BYTES)
            conn.nonces = _nonce(message) + server_nonce
            conn.stage = "proof"
            conn.channel.send("challenge", nonce=server_nonce.hex())
        elif conn.stage == "proof":
            proof = _nonce(message, "proof") if message.get("kind") == "proof" else b""
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", conn.nonces)):
                if message.get("kind") == "proof":  # A node of another run, or one given another secret.
                    self._wrong_secret_hosts.add(conn.peer)
                    conn.channel.send("rejected")  # Says no more than closing would; the node stops trying.
                raise ProtocolError(f"it did not prove it holds the run's secret ({SECRET_ENV} / {SECRET_FLAG})")
            conn.channel.send("welcome", proof=_mac(self._secret, b"server", conn.nonces).hex())
            conn.channel.secure(
                _mac(self._secret, b"server to node", conn.nonces),
                _mac(self._secret, b"node to server", conn.nonces),
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


# ------------------------------------------------------------------------------ a node


class RendezvousClient:
    """A node's side: prove the secret and check node 0's proof, join, then read what the
    server decides (see the module doc). `failure` says why the last connection failed."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        heartbeat_timeout: float,
        secret: bytes | None = None,
        workers_per_node: int = 1,
    ):
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self.workers_per_node = workers_per_node
        self._secret = secret or b""
        self._channel: _Channel | None = None
        self._next_beat = 0.0
        self.failure: str | None = None
        self.unproven: str | None = None  # Why a server that answered did not prove the secret.
        self.rejected = False  # Node 0 said our proof is of another secret: no retry helps.

    @property
    def connected(self) -> bool:
        return self._channel is not None and not self._channel.closed

    def connect(self, deadline: float) -> bool:
        """Tries until `deadline` (node 0 may start after us), handshake included: True once
        both sides have proved the secret, False if no server did by then. A server that
        accepts and never answers costs this call's time, never more than `deadline`."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                sock = socket.create_connection(self.address, timeout=min(2.0, remaining))
            except OSError as error:
                self.failure = f"cannot connect ({error.strerror or error})"
            else:
                sock.setblocking(False)
                channel = _Channel(sock)
                try:
                    self._handshake(channel, min(deadline, time.monotonic() + HANDSHAKE_SECONDS))
                except ProtocolError as error:
                    channel.close()
                    self.failure = str(error)
                    if self.rejected:
                        return False
                else:
                    self._channel = channel
                    self.failure = None
                    return True
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))

    def _handshake(self, channel: _Channel, deadline: float) -> None:
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        channel.send("hello", protocol=PROTOCOL, nonce=client_nonce.hex())
        challenge = self._expect(channel, "challenge", deadline)
        nonces = client_nonce + _nonce(challenge)
        channel.send("proof", proof=_mac(self._secret, b"client", nonces).hex())
        welcome = self._expect(channel, "welcome", deadline, after_proof=True)
        if not hmac.compare_digest(_nonce(welcome, "proof"), _mac(self._secret, b"server", nonces)):
            self.unproven = (
                f"the server did not prove it holds the run's secret: not node 0's rendezvous, or node 0 "
                f"has another {SECRET_ENV} / {SECRET_FLAG}"
            )
            raise ProtocolError(self.unproven)
        channel.secure(
            _mac(self._secret, b"node to server", nonces), _mac(self._secret, b"server to node", nonces)
        )

    def _expect(
        self, channel: _Channel, kind: str, deadline: float, *, after_proof: bool = False
    ) -> dict[str, Any]:
        with selectors.DefaultSelector() as selector:
            selector.register(channel.sock, selectors.EVENT_READ)
            while True:
                messages = channel.take(1)
                if messages:
                    if after_proof and messages[0].get("kind") == "rejected":
                        self.rejected = True
                        self.unproven = (
                            f"node 0 rejected this node's proof of the secret: give every node the same "
                            f"{SECRET_ENV} or {SECRET_FLAG}"
                        )
                        raise ProtocolError(self.unproven)
                    if messages[0].get("kind") != kind:
                        raise ProtocolError(f"the server answered {_shown(messages[0].get('kind'))}, not {kind}")
                    return messages[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProtocolError("the server did not answer the handshake in time")
                if selector.select(remaining):
                    channel.fill()
                    if channel.closed:
                        if after_proof:  # Our proof was refused: another secret on node 0.
                            self.unproven = (
                                f"node 0 refused this node's proof of the secret: give every node the same "
                                f"{SECRET_ENV} or {SECRET_FLAG}"
                            )
                            raise ProtocolError(self.unproven)
                        raise ProtocolError("the server closed the connection during the handshake")

    def send(self, kind: str, **fields: Any) -> None:
        if self._channel is not None:
            self._channel.send(kind, **fields)

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """Messages that arrive within `timeout` s (beats answered, not returned); a server
        silent past the heartbeat bound, or one that sends what the protocol does not, closes
        the connection (`connected` turns False, `failure` says why)."""
        channel = self._channel
        if channel is None or channel.closed:
            return []
        with selectors.DefaultSelector() as selector:
            selector.register(channel.sock, selectors.EVENT_READ)
            ready = selector.select(timeout)
        try:
            if ready:
                channel.fill()
            messages = channel.take()
            for message in messages:
                check_from_server(message, workers_per_node=self.workers_per_node)
        except ProtocolError as error:
            self.failure = str(error)
            channel.close()
            return []
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + BEAT_SECONDS
            channel.send("beat")
        if self.heartbeat_timeout and now - channel.last_heard > self.heartbeat_timeout:
            self.failure = f"node 0 sent nothing for {self.heartbeat_timeout:g} s"
            channel.close()
        return [message for message in messages if message["kind"] != "beat"]

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
