"""A joining node's side of the rendezvous (every node's launcher, node 0's too): it proves
the secret and checks node 0's proof, joins, then reads what the server decides.

A node whose proof node 0 rejects ends at once (`rejected`: another secret, no retry
helps); any other failed connection is retried until the caller's deadline, since node
0 may start after this node.
"""

from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import time
from typing import Any

from engine.launch.rendezvous.protocol import (
    BEAT_SECONDS,
    HANDSHAKE_SECONDS,
    NONCE_BYTES,
    PROTOCOL,
    Channel,
    ProtocolError,
    brief,
    check_from_server,
    mac,
    nonce_of,
)
from engine.launch.rendezvous.secret import SECRET_ENV, SECRET_FLAG


class RendezvousClient:
    """A node's side: prove the secret and check node 0's proof, join, then read what the
    server decides (see `engine.launch.rendezvous`). `failure` says why the last connection failed."""

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
        self._channel: Channel | None = None
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
                channel = Channel(sock)
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

    def _handshake(self, channel: Channel, deadline: float) -> None:
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        channel.send("hello", protocol=PROTOCOL, nonce=client_nonce.hex())
        challenge = self._expect(channel, "challenge", deadline)
        nonces = client_nonce + nonce_of(challenge)
        channel.send("proof", proof=mac(self._secret, b"client", nonces).hex())
        welcome = self._expect(channel, "welcome", deadline, after_proof=True)
        if not hmac.compare_digest(nonce_of(welcome, "proof"), mac(self._secret, b"server", nonces)):
            self.unproven = (
                f"the server did not prove it holds the run's secret: not node 0's rendezvous, or node 0 "
                f"has another {SECRET_ENV} / {SECRET_FLAG}"
            )
            raise ProtocolError(self.unproven)
        channel.secure(
            mac(self._secret, b"node to server", nonces), mac(self._secret, b"server to node", nonces)
        )

    def _expect(
        self, channel: Channel, kind: str, deadline: float, *, after_proof: bool = False
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
                        raise ProtocolError(f"the server answered {brief(messages[0].get('kind'))}, not {kind}")
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
