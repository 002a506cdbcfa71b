"""The rendezvous's wire protocol: frames, messages and their schemas, and the HMAC
challenge and proof by which both sides show they hold the run's secret.

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

and then, authenticated (`Channel.secure`: one session key per direction, an HMAC
of each body and its sequence number, so nothing can be injected, changed,
replayed or reordered):

    node -> server   join {rank, ports, host, settings, digest}  beat  failed {cause, status}
                     stop {cause, status}  done
    server -> node   round {spec, first_index, nodes, restarts, lost_s}  beat
                     restart {cause, restarts, max_restarts}  end {status, reason}

A join carries the node's run settings (the flags that must be equal everywhere)
and their digest (`settings_digest`); node 0 names the flags that differ
(`settings_difference`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import socket
import time
from collections.abc import Mapping
from typing import Any

BEAT_SECONDS = 1.0
PROTOCOL = "engine-rendezvous-2"
HANDSHAKE_FRAME_BYTES = 512
MAX_FRAME_BYTES = 1 << 20  # A round of ~40,000 workers' addresses; TF_CONFIG itself stops far below.
# A connection that has not proved the secret by then is dropped: a node proves it in two round
# trips (milliseconds, a second on a slow link), an idle stranger holds a slot no longer.
HANDSHAKE_SECONDS = 5.0
MAX_TEXT = 2000  # A cause, a reason, an address: longer text is not ours.
MAX_SETTINGS = 512
MAX_SETTING_TEXT = 4096
LAUNCH_SETTING = "engine.launch "  # The prefix of the launcher's own settings among a node's.
_MAC_BYTES = hashlib.sha256().digest_size
NONCE_BYTES = 32
_HOST = re.compile(r"^[A-Za-z0-9._:%\-\[\]]{1,253}$")  # A host name or an IP literal, nothing more.
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def parse_address(value: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming the value otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (a port from 1 to 65535)")
    return host.strip("[]"), int(port)


def valid_host(host: str) -> bool:
    """Whether `host` can stand in a HOST:PORT address: a name or an IP literal, nothing more."""
    return bool(_HOST.match(host))


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts` under `key`, bound to this protocol and to `label` (whose proof or
    which direction's key), so that no value made for one use passes for another."""
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
            f"{message.get('kind')}.{name}={brief(value)} is not an integer from {low} to {high}"
        )
    return value


def _text(message: Mapping[str, Any], name: str, limit: int = MAX_TEXT) -> str:
    value = message.get(name)
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(
            f"{message.get('kind')}.{name}={brief(value)} is not a text of at most {limit} characters"
        )
    return value


def brief(value: Any) -> str:
    """`value` as a message quotes it: its repr, cut to 40 characters."""
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
            raise ProtocolError(f"join.ports={brief(ports)} is not {workers_per_node} port(s) from 1 to 65535")
        host = message.get("host")
        if host is not None and (not isinstance(host, str) or not valid_host(host)):
            raise ProtocolError(f"join.host={brief(host)} is not a host name or address")
        _check_settings(message)
    elif kind in ("failed", "stop"):
        _integer(message, "status", 1, 255)
        _text(message, "cause")
    elif kind not in ("beat", "done"):
        raise ProtocolError(f"{brief(kind)} is not a message a node sends")


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
                raise ProtocolError(f"round.spec has {brief(address)}, not HOST:PORT")
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
            raise ProtocolError(f"round.lost_s={brief(lost)} is not a duration")
    elif kind == "restart":
        _text(message, "cause")
        _integer(message, "restarts", 1, 2**31 - 1)
        _integer(message, "max_restarts", 1, 2**31 - 1)
    elif kind == "end":
        _integer(message, "status", 0, 255)
        _text(message, "reason")
    elif kind != "beat":
        raise ProtocolError(f"{brief(kind)} is not a message the rendezvous sends")


class Channel:
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
            body = mac(self._send_key, b"message", self._sent.to_bytes(8, "big"), body) + body
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
            expected = mac(self._receive_key, b"message", self._received.to_bytes(8, "big"), frame)
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


def nonce_of(message: Mapping[str, Any], name: str = "nonce") -> bytes:
    """The 32 bytes of a handshake message's hex field `name` (a nonce or a proof)."""
    value = message.get(name)
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ProtocolError(f"{message.get('kind')}.{name} is not 64 hex digits")
    return bytes.fromhex(value)
