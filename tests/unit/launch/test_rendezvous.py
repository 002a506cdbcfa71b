"""The multi-host launcher's rendezvous (engine.launch.rendezvous), with clients in this process:
who is in a round, when a round restarts, shrinks or ends, and the one line of each end; who
gets in (the secret, both ways), what a connection may send, and how long a node waits.

Covers: engine/launch/rendezvous/protocol.py, engine/launch/rendezvous/secret.py,
engine/launch/rendezvous/server_side.py, engine/launch/rendezvous/client_side.py
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time

import pytest
from helpers import free_ports

from engine.errors import PEER_LOST_EXIT
from engine.launch import rendezvous
from engine.launch.rendezvous import (
    RendezvousClient,
    RendezvousServer,
    parse_address,
    settings_difference,
    settings_digest,
)

SECRET = b"0123456789abcdef0123456789abcdef"
SETTINGS = {"learning_rate": "0.1", "seed": "42", "train_steps": "400", "engine.launch workers_per_node": "1"}


def serve(nnodes: int, **options) -> RendezvousServer:
    settings = dict(
        nnodes=nnodes,
        min_nodes=nnodes,
        max_restarts=0,
        startup_timeout=20.0,
        rejoin_timeout=20.0,
        heartbeat_timeout=10.0,
        secret=SECRET,
    )
    settings.update(options)
    return RendezvousServer(("127.0.0.1", free_ports(1)[0]), **settings).start()


def address(server: RendezvousServer) -> tuple[str, int]:
    host, port = server.address_text.rsplit(":", 1)
    return host, int(port)


def connect(server: RendezvousServer, secret: bytes = SECRET, workers_per_node: int = 1) -> RendezvousClient:
    client = RendezvousClient(
        address(server), heartbeat_timeout=10.0, secret=secret, workers_per_node=workers_per_node
    )
    assert client.connect(time.monotonic() + 10), client.failure
    return client


def join(server: RendezvousServer, rank: int, ports: list[int], settings=None) -> RendezvousClient:
    client = connect(server, workers_per_node=len(ports))
    settings = server.settings if settings is None else settings
    client.send("join", rank=rank, ports=ports, host=None, settings=settings, digest=settings_digest(settings))
    return client


@pytest.fixture
def quick_beats(monkeypatch):
    """Beats every 0.25 s (1 s: BEAT_SECONDS), so that a heartbeat bound of 1 s holds four of them
    and a silent node is found in a second."""
    monkeypatch.setattr(rendezvous.client_side, "BEAT_SECONDS", 0.25)
    monkeypatch.setattr(rendezvous.server_side, "BEAT_SECONDS", 0.25)


def next_message(client: RendezvousClient, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = client.poll(0.1)
        if messages:
            return messages[0]
    raise AssertionError("no message from the rendezvous")


def test_a_round_gives_every_node_every_address_in_rank_order():
    server = serve(2, workers_per_node=2)
    second = join(server, 1, [7001, 7002])
    first = join(server, 0, [6001, 6002])
    rounds = [next_message(first), next_message(second)]
    assert all(message["kind"] == "round" for message in rounds)
    workers = ["127.0.0.1:6001", "127.0.0.1:6002", "127.0.0.1:7001", "127.0.0.1:7002"]
    assert [message["spec"] for message in rounds] == [{"worker": workers}] * 2
    assert [message["first_index"] for message in rounds] == [0, 2]
    assert rounds[0]["restarts"] == 0
    for client in (first, second):
        client.send("done")
    assert [next_message(client)["kind"] for client in (first, second)] == ["end", "end"]
    assert server.status == 0


def test_a_failure_restarts_every_node_until_the_restarts_are_spent():
    server = serve(2, max_restarts=1)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    assert [next_message(client)["kind"] for client in clients] == ["round", "round"]
    clients[1].send("failed", cause="worker:1 exited with signal 9", status=137)
    restarts = [next_message(client) for client in clients]
    assert [(m["kind"], m["cause"], m["restarts"]) for m in restarts] == [
        ("restart", "worker:1 exited with signal 9", 1)
    ] * 2
    for client in clients:
        client.close()
    clients = [join(server, rank, [6100 + rank]) for rank in (0, 1)]
    again = [next_message(client) for client in clients]
    assert [m["kind"] for m in again] == ["round", "round"] and again[0]["restarts"] == 1
    assert again[0]["spec"] == {"worker": ["127.0.0.1:6100", "127.0.0.1:6101"]}  # fresh ports
    clients[0].send("failed", cause="worker:0 exited with status 1", status=1)
    ends = [next_message(client) for client in clients]
    # Failed again with its one restart spent: not the task's 1, which a scheduler might retry.
    assert [(m["kind"], m["status"], m["reason"]) for m in ends] == [
        ("end", 3, "worker:0 exited with status 1; the 1 restart(s) of --max_restarts are spent")
    ] * 2


def test_bad_flags_are_never_restarted():
    server = serve(2, max_restarts=5)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    [next_message(client) for client in clients]
    clients[0].send("failed", cause="worker:0 exited with status 2", status=2)
    assert next_message(clients[1])["kind"] == "end" and server.status == 2


def test_a_node_stopped_while_it_waits_for_its_round_ends_the_run_on_every_node():
    server = serve(3)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]  # node 2 has not come yet
    wait_until(lambda: set(server._joined) == {0, 1})
    clients[1].send("stop", status=143, cause="node 1 received SIGTERM")
    ends = [next_message(client) for client in clients]
    assert [(m["kind"], m["status"], m["reason"]) for m in ends] == [("end", 143, "node 1 received SIGTERM")] * 2


def test_a_node_that_never_joins_ends_the_start_up_naming_it():
    server = serve(3, startup_timeout=0.5)
    client = join(server, 0, [6000])
    message = next_message(client)
    assert message["kind"] == "end" and message["status"] == PEER_LOST_EXIT
    assert message["reason"].startswith("node(s) 1, 2 of --nnodes=3 never joined the rendezvous at 127.0.0.1:")
    assert "within 0.5 s (--startup_timeout)" in message["reason"]


def test_a_cluster_shrinks_to_the_nodes_that_come_back_within_the_rejoin_window():
    server = serve(3, min_nodes=2, max_restarts=1, rejoin_timeout=0.5)
    clients = [join(server, rank, [6000 + rank]) for rank in range(3)]
    [next_message(client) for client in clients]
    clients[2].close()  # Its launcher (or host) is gone.
    restarts = [next_message(client) for client in clients[:2]]
    assert [m["kind"] for m in restarts] == ["restart", "restart"]
    assert "node 2 left the rendezvous" in restarts[0]["cause"]
    for client in clients[:2]:
        client.close()
    began = time.monotonic()
    clients = [join(server, rank, [6100 + rank]) for rank in range(2)]
    rounds = [next_message(client) for client in clients]
    assert time.monotonic() - began >= 0.45  # it waited for node 2 first
    assert [m["kind"] for m in rounds] == ["round", "round"]
    assert rounds[0]["spec"] == {"worker": ["127.0.0.1:6100", "127.0.0.1:6101"]} and rounds[0]["nodes"] == [0, 1]


def test_too_few_nodes_back_end_the_run_naming_the_missing_ones():
    server = serve(3, min_nodes=3, max_restarts=2, startup_timeout=0.5)
    clients = [join(server, rank, [6000 + rank]) for rank in range(3)]
    [next_message(client) for client in clients]
    clients[1].send("failed", cause="worker:1 exited with signal 9", status=137)
    [next_message(client) for client in clients]
    for client in clients:
        client.close()
    clients = [join(server, rank, [6100 + rank]) for rank in (0, 2)]
    message = next_message(clients[0])
    assert message["kind"] == "end" and message["status"] == PEER_LOST_EXIT
    assert message["reason"] == (
        "node(s) 1 did not come back within 0.5 s and 2 node(s) are fewer than --min_nodes=3"
    )


def test_a_node_that_falls_silent_fails_its_round(quick_beats):
    server = serve(2, max_restarts=1, heartbeat_timeout=1.0)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    [next_message(client) for client in clients]
    began = time.monotonic()
    # Node 1 stops answering: its client is never polled again, so it sends no beat.
    message = next_message(clients[0], timeout=10)
    assert message == {**message, "kind": "restart", "cause": "node 1 stopped answering the rendezvous"}
    assert time.monotonic() - began < 1.0 + 2


@pytest.mark.parametrize("how", ["silent", "gone"])
def test_a_node_the_rendezvous_loses_ends_a_run_without_restarts_as_restartable(how, quick_beats):
    server = serve(2, max_restarts=0, heartbeat_timeout=1.0)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    [next_message(client) for client in clients]
    if how == "gone":
        clients[1].close()  # its launcher ended, or its host went down with its connections
    message = next_message(clients[0], timeout=10)  # "silent": node 1's client is never polled again
    cause = {
        "silent": "node 1 stopped answering the rendezvous",
        "gone": "node 1 left the rendezvous (its launcher ended or its host went down)",
    }[how]
    # 69 (a peer is unavailable: restartable), not 1 (a bug), in the docs' table.
    assert (message["kind"], message["status"], message["reason"]) == ("end", PEER_LOST_EXIT, cause)


def test_two_launchers_with_one_rank_are_refused():
    server = serve(2)
    first = join(server, 0, [6000])
    duplicate = join(server, 0, [6001])
    message = next_message(duplicate)
    assert message["kind"] == "end" and message["reason"] == "two launchers say --node_rank=0"
    assert first.connected  # the first one keeps its place


@pytest.mark.parametrize("value", ["nohost", "host:", "host:0", "host:70000", ":29400"])
def test_an_address_that_is_not_host_port_is_named(value):
    with pytest.raises(ValueError, match=f"^{value!r} is not HOST:PORT"):
        parse_address(value)


# ---------------------------------------------------------------- strangers and what they send


def frame(body: bytes | dict) -> bytes:
    """One frame of the wire format: a 4-byte length, then the body."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return len(data).to_bytes(4, "big") + data


def send_as_stranger(server: RendezvousServer, data: bytes, wait: float = 3.0) -> bytes:
    """`data` on a connection of its own; what the server answered before it closed it."""
    answered = b""
    with socket.create_connection(address(server), timeout=wait) as sock:
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                answered += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return answered


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def hello(nonce: bytes = b"\1" * 32) -> bytes:
    return frame({"kind": "hello", "protocol": rendezvous.PROTOCOL, "nonce": nonce.hex()})


def test_the_server_survives_what_strangers_send_and_the_run_forms_after(monkeypatch):
    monkeypatch.setattr(rendezvous.server_side, "HANDSHAKE_SECONDS", 0.5)
    warnings: list[str] = []
    server = serve(2, settings=SETTINGS, warn=warnings.append)
    sent = [
        b"[" * 100_000 + b"\n",  # killed the old server's thread
        (1 << 31).to_bytes(4, "big") + b"x" * 1000,  # a frame far over the limit
        frame(b"x" * 513),  # just over the handshake's limit
        frame(b"{not json"),
        frame(b"[" * 500),  # nested past what is a message, within the limit
        frame({"kind": "hello", "protocol": "engine-rendezvous-1", "nonce": "00" * 32}),
        frame({"kind": "join", "rank": 1, "ports": [1], "host": "10.0.0.9"}),  # a forged join
        b'{"kind": "stop", "status": 0, "cause": "forged"}\n',  # the old protocol's forged stop
        hello() + frame({"kind": "proof", "proof": "00" * 32}),  # a wrong HMAC
        hello() + frame({"kind": "join", "rank": 1, "ports": [1]}),  # a join instead of the proof
        b"",  # a connection that says nothing
    ]
    for data in sent:
        answered = send_as_stranger(server, data)
        assert b"round" not in answered and b"end" not in answered, answered
    wait_until(lambda: server.dropped == len(sent))
    assert server.alive and server.status is None
    assert 1 <= len(warnings) <= len(sent) and all(
        line.startswith("warning: dropped a connection from 127.0.0.1: ") for line in warnings
    ), warnings
    first, second = join(server, 0, [6000]), join(server, 1, [6001])
    rounds = [next_message(client) for client in (first, second)]
    assert [message["kind"] for message in rounds] == ["round", "round"]
    assert rounds[0]["spec"] == {"worker": ["127.0.0.1:6000", "127.0.0.1:6001"]}


def test_a_node_with_the_secret_is_dropped_for_a_message_off_its_schema(monkeypatch):
    monkeypatch.setattr(rendezvous.server_side, "_WARNINGS_PER_WINDOW", 100)  # every line, to check each reason
    warnings: list[str] = []
    server = serve(2, settings=SETTINGS, warn=warnings.append)
    digest = settings_digest(SETTINGS)
    join_fields = dict(rank=1, ports=[6001], host=None, settings=SETTINGS, digest=digest)
    bad = [  # (what the node sends, why the server drops it)
        ("join", {**join_fields, "ports": [-5]}, "join.ports=[-5] is not 1 port(s) from 1 to 65535"),  # exit 2
        ("join", {**join_fields, "ports": list(range(1, 60_001)) * 2}, "join.ports=[1, 2, 3,"),  # E2BIG
        ("join", {**join_fields, "ports": [6001, 6002]}, "join.ports=[6001, 6002] is not 1 port(s)"),
        ("join", {**join_fields, "rank": "1"}, "join.rank='1' is not an integer from 0"),
        ("join", {**join_fields, "host": "a b;rm -rf"}, "join.host='a b;rm -rf' is not a host name"),
        ("join", {**join_fields, "digest": "0" * 64}, "join.digest is not the digest of join.settings"),
        ("failed", {"cause": "x", "status": "x"}, "failed.status='x' is not an integer from 1 to 255"),
        ("stop", {"cause": "x", "status": 0}, "stop.status=0 is not an integer from 1 to 255"),  # exit 0
        ("stop", {"cause": "x" * 3000, "status": 143}, "stop.cause='xxxxxxxxx"),
        ("restart", {"cause": "x"}, "'restart' is not a message a node sends"),
    ]
    for kind, fields, _ in bad:
        client = connect(server)
        client.send(kind, **fields)
        wait_until(lambda client=client: (client.poll(0.05), not client.connected)[1])
    wait_until(lambda: server.dropped == len(bad))
    assert server.alive and server.status is None and not server._joined
    prefix = "warning: dropped a connection from 127.0.0.1: "
    assert len(warnings) == len(bad), warnings
    for line, (_, _, why) in zip(warnings, bad, strict=True):
        assert line.startswith(prefix + why), (line, why)
    first, second = join(server, 0, [6000]), join(server, 1, [6001])
    assert [next_message(client)["kind"] for client in (first, second)] == ["round", "round"]


def test_a_replayed_or_injected_message_drops_the_connection():
    warnings: list[str] = []
    server = serve(2, warn=warnings.append)
    member = join(server, 1, [6001])
    wait_until(lambda: 1 in server._joined)
    channel = member._channel
    assert channel is not None
    body = json.dumps({"kind": "stop", "status": 143, "cause": "replayed"}).encode()
    # The HMAC of message 0 (its join) again: right key, spent sequence number.
    replayed = rendezvous.protocol.mac(channel._send_key, b"message", (0).to_bytes(8, "big"), body) + body
    channel.sock.sendall(frame(replayed))
    wait_until(lambda: server.dropped == 1)
    assert server.status is None and 1 not in server._joined and server.alive
    assert "HMAC is wrong" in warnings[-1], warnings

    # A recorded handshake, replayed on a new connection: the server's nonce is new each time.
    with socket.create_connection(address(server), timeout=5) as sock:
        sock.sendall(hello(b"\2" * 32))
        challenge = json.loads(sock.recv(4096)[4:])
    nonces = b"\2" * 32 + bytes.fromhex(challenge["nonce"])
    recorded = frame({"kind": "proof", "proof": rendezvous.protocol.mac(SECRET, b"client", nonces).hex()})
    assert send_as_stranger(server, hello(b"\2" * 32) + recorded)[4:].startswith(b'{"kind":"challenge"')
    wait_until(lambda: server.dropped == 2)
    assert "did not prove it holds the run's secret" in warnings[-1] and server.status is None


def test_a_node_without_the_secret_or_with_another_is_never_admitted_and_told_at_once():
    server = serve(2)
    for secret in (b"", b"another secret of 32 characters!"):
        client = RendezvousClient(address(server), heartbeat_timeout=10.0, secret=secret)
        began = time.monotonic()
        assert not client.connect(time.monotonic() + 10)
        assert time.monotonic() - began < 1.0  # rejected, not retried until the deadline
        assert client.rejected and client.unproven is not None
        assert client.unproven.startswith("node 0 rejected this node's proof of the secret: give every node")
    wait_until(lambda: server.dropped == 2)  # The server counts a drop after its `rejected` is sent.
    assert server.status is None and not server._joined


class IdleStranger:
    """`count` sockets to the server from another loopback address (127.0.0.2) that never send
    a byte, each reopened as soon as the server drops it, until `stop` (bounded: 30 s)."""

    def __init__(self, server: RendezvousServer, count: int):
        self.server, self.count = server, count
        self.reopened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> IdleStranger:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()

    def _open(self, selector) -> None:
        sock = socket.create_connection(address(self.server), timeout=2, source_address=("127.0.0.2", 0))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    def _hold(self) -> None:
        deadline = time.monotonic() + 30
        with selectors.DefaultSelector() as selector:
            try:
                for _ in range(self.count):
                    self._open(selector)
                while not self.stop.is_set() and time.monotonic() < deadline:
                    for key, _ in selector.select(0.05):  # readable: the server dropped it
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                        if not self.stop.is_set():
                            self._open(selector)
                            self.reopened += 1
            finally:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()


@pytest.mark.parametrize("sockets", [64, pytest.param(1000, marks=pytest.mark.slow)])  # 1000: ~6 s to open
def test_idle_strangers_at_one_address_never_keep_a_node_at_another_out(sockets):
    warnings: list[str] = []
    server = serve(2, warn=warnings.append)
    first = join(server, 0, [6000])
    with IdleStranger(server, sockets) as stranger:
        wait_until(
            lambda: server.dropped >= sockets - rendezvous.server_side.MAX_UNPROVEN_PER_ADDRESS, timeout=20
        )
        # Every slot the stranger holds is one of its own address's: the node's address has its own.
        began = time.monotonic()
        second = join(server, 1, [6001])
        rounds = [next_message(client, timeout=5) for client in (first, second)]
        took = time.monotonic() - began
        held = [conn.source for conn in list(server._conns.values())].count("127.0.0.2")  # list(): at once
    assert [message["kind"] for message in rounds] == ["round", "round"]
    assert took < 3.0, took
    assert (
        held <= rendezvous.server_side.MAX_UNPROVEN_PER_ADDRESS and stranger.reopened > 0
    )  # it kept coming back
    stranger_lines = [line.startswith("warning: dropped a connection from 127.0.0.2: ") for line in warnings]
    assert stranger_lines and all(stranger_lines), warnings
    assert server.status is None and server.alive


def test_strangers_at_many_addresses_leave_room_for_a_node(monkeypatch):
    monkeypatch.setattr(rendezvous.server_side, "MAX_UNPROVEN", 6)
    monkeypatch.setattr(rendezvous.server_side, "MAX_UNPROVEN_PER_ADDRESS", 4)
    server = serve(1)
    held = [
        socket.create_connection(address(server), timeout=2, source_address=(f"127.0.0.{2 + index % 3}", 0))
        for index in range(12)
    ]
    try:
        wait_until(lambda: len(server._conns) == 6 and server.dropped == 6)
        # Full: a node at yet another address takes the oldest slot of the address holding the most.
        node = join(server, 0, [6000])
        assert next_message(node)["kind"] == "round"
        stages = [conn.stage for conn in list(server._conns.values())]  # list(): at once, as the server runs
        assert len(stages) - stages.count("ready") <= 6
    finally:
        for sock in held:
            sock.close()


def test_a_slot_is_per_ipv4_address_or_ipv6_64():
    assert rendezvous.source_of("10.0.0.7") == "10.0.0.7"
    assert rendezvous.source_of("::ffff:10.0.0.7") == "10.0.0.7"
    assert rendezvous.source_of("2001:db8:1:2:aaaa::1") == rendezvous.source_of("2001:db8:1:2:bbbb::9")
    assert rendezvous.source_of("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert rendezvous.source_of("2001:db8:1:3::1") != rendezvous.source_of("2001:db8:1:2::1")


def test_a_node_with_another_secret_exits_2_at_once_and_node_0_ends_2_at_its_startup_timeout(capsys):
    from engine.launch import node_launcher

    warnings: list[str] = []
    server = serve(2, startup_timeout=2.0, warn=warnings.append)
    first = join(server, 0, [6000])
    options = node_launcher.NodeOptions(nnodes=2, node_rank=1, rendezvous=address(server), startup_timeout=30)
    node = node_launcher.NodeLauncher(options, [], secret=b"another secret of 32 characters!")
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(node_launcher.StopSignals, "install", lambda self: None)
        status = node.run()
    took = time.monotonic() - began
    lines = capsys.readouterr().err.splitlines()
    assert status == 2 and took < 1.5, (status, took)
    assert lines == [
        f"[launch node 1] error: the rendezvous at {server.address_text}: node 0 rejected this node's proof "
        "of the secret: give every node the same ENGINE_RENDEZVOUS_SECRET or --rendezvous_secret_file"
    ]
    # Node 0 is not ended by a wrong proof (a stranger could send one): one line, and it waits on.
    wait_until(lambda: server.dropped == 1)  # The server warns and counts after its `rejected` is sent.
    assert server.status is None and server.alive
    assert warnings == [
        "warning: dropped a connection from 127.0.0.1: it did not prove it holds the run's secret "
        "(ENGINE_RENDEZVOUS_SECRET / --rendezvous_secret_file)"
    ]
    message = next_message(first)
    assert (message["kind"], message["status"]) == ("end", 2)
    assert message["reason"] == (
        f"node(s) 1 of --nnodes=2 never joined the rendezvous at {server.address_text} within 2 s "
        "(--startup_timeout), and node 0 refused a node at 127.0.0.1 whose secret is another: give every "
        "node the same ENGINE_RENDEZVOUS_SECRET or --rendezvous_secret_file"
    )


def test_a_wrong_proof_never_ends_a_run_whose_nodes_all_come():
    server = serve(2, startup_timeout=2.0)
    guess = b"a stranger's guess, 32 bytes...."
    stranger = RendezvousClient(address(server), heartbeat_timeout=10.0, secret=guess)
    assert not stranger.connect(time.monotonic() + 5) and stranger.rejected
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    assert [next_message(client)["kind"] for client in clients] == ["round", "round"]
    for client in clients:
        client.send("done")
    assert [next_message(client)["status"] for client in clients] == [0, 0]


def fake_node_0(listener: socket.socket, *, answer: bool) -> None:
    """A server at node 0's address: with `answer`, one that plays the handshake without the
    secret (its proof is made up); else one that accepts connections and never says a word."""
    listener.settimeout(0.2)
    held = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        held.append(sock)
        if answer:
            sock.settimeout(2)
            sock.recv(4096)
            sock.sendall(frame({"kind": "challenge", "nonce": "ab" * 32}))
            sock.recv(4096)
            sock.sendall(frame({"kind": "welcome", "proof": "cd" * 32}))
    for sock in held:
        sock.close()


@pytest.mark.parametrize("answer", [False, True], ids=["silent", "without-the-secret"])
def test_a_node_gives_up_on_a_server_that_never_proves_itself_within_the_startup_timeout_in_all(answer, capsys):
    from engine.launch import node_launcher

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=fake_node_0, args=(listener,), kwargs={"answer": answer}, daemon=True).start()
    options = node_launcher.NodeOptions(
        nnodes=2,
        node_rank=1,
        rendezvous=listener.getsockname(),
        startup_timeout=1.0,
        heartbeat_timeout=0.5,  # each reconnect restarted the old wait; the bound is in all now
    )
    node = node_launcher.NodeLauncher(options, [], secret=SECRET)
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(node_launcher.StopSignals, "install", lambda self: None)
        status = node.run()
    took = time.monotonic() - began
    listener.close()
    lines = capsys.readouterr().err.splitlines()
    assert took < 1.0 + 1.0, took
    assert len(lines) == 1, lines
    host, port = options.rendezvous
    if answer:
        assert status == 2
        assert lines[0].startswith(f"[launch node 1] error: no rendezvous at {host}:{port} within 1 s ")
        assert "that shares the secret: the server did not prove it holds the run's secret" in lines[0]
    else:
        assert status == PEER_LOST_EXIT
        assert "(last: the server did not answer the handshake in time)" in lines[0], lines[0]


# ---------------------------------------------------------------- the nodes agree on the run


def test_a_node_given_other_settings_ends_every_node_naming_the_flags():
    server = serve(2, settings=SETTINGS)
    first = join(server, 0, [6000])
    second = join(server, 1, [6001], settings={**SETTINGS, "learning_rate": "0.01"})
    ends = [next_message(client) for client in (first, second)]
    reason = (
        "node 1's --learning_rate=0.01 differs from node 0's --learning_rate=0.1; "
        "give every node the same flags after --"
    )
    assert [(m["kind"], m["status"], m["reason"]) for m in ends] == [("end", 2, reason)] * 2
    assert server.status == 2


def test_the_difference_names_every_differing_flag_and_the_launchers_own():
    ours = {"model": "mlp", "train_steps": "400", "epochs": None, "engine.launch workers_per_node": "1"}
    theirs = {**ours, "model": "cnn", "train_steps": None, "epochs": "2.0"}
    assert settings_difference(2, theirs, ours) == (
        "node 2's --epochs=2.0, --model=cnn, --train_steps unset differ from node 0's --epochs unset, "
        "--model=mlp, --train_steps=400; give every node the same flags after --"
    )
    assert settings_difference(1, {**ours, "engine.launch workers_per_node": "2"}, ours) == (
        "node 1's --workers_per_node=2 differs from node 0's --workers_per_node=1; run the same "
        "engine.launch command on every node, changing only --node_rank"
    )
    assert settings_difference(1, dict(ours), ours) is None


# ---------------------------------------------------------------- the secret


def test_the_secret_comes_from_the_file_flag_or_else_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-the-file-0123456789\n")
    path.chmod(0o600)
    environment = {rendezvous.SECRET_ENV: " from-the-environment-0123 "}
    assert rendezvous.read_secret(str(path), environment) == b"from-the-file-0123456789"
    assert rendezvous.read_secret(None, environment) == b"from-the-environment-0123"
    assert rendezvous.read_secret(None, {}) is None


@pytest.mark.parametrize(
    "case", ["short-file", "short-env", "fifo", "missing", "directory", "world-readable", "group-writable"]
)
def test_a_secret_that_is_not_one_is_one_line_naming_its_source(tmp_path, case):
    path = tmp_path / "secret"
    environment: dict[str, str] = {}
    if case == "short-file":
        path.write_text("password\n")
        path.chmod(0o600)
        expected = f"--rendezvous_secret_file={path} holds a secret of 8 byte(s); use at least 16 random ones"
    elif case == "short-env":
        environment[rendezvous.SECRET_ENV] = "abc"
        path = None
        expected = "ENGINE_RENDEZVOUS_SECRET holds a secret of 3 byte(s); use at least 16"
    elif case == "fifo":
        os.mkfifo(path)  # never blocks the launcher
        expected = f"--rendezvous_secret_file={path} must be a regular file of at most 4096 bytes"
    elif case == "missing":
        expected = f"--rendezvous_secret_file={path}: cannot read it (No such file or directory)"
    elif case in ("world-readable", "group-writable"):
        path.write_text("0123456789abcdef0123456789abcdef\n")
        mode = 0o644 if case == "world-readable" else 0o620
        path.chmod(mode)  # refused as ssh refuses such a private key
        expected = (
            f"--rendezvous_secret_file={path} may be read or written by other users (mode {mode:04o}), and "
            f"whoever reads the secret can join and steer the run: `chmod 600 {path}`"
        )
    else:
        path.mkdir()
        expected = f"--rendezvous_secret_file={path} must be a regular file"
    with pytest.raises(ValueError) as raised:
        rendezvous.read_secret(None if path is None else str(path), environment)
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value), str(raised.value)


def test_a_secret_is_required_off_loopback_only():
    assert rendezvous.is_loopback("127.0.0.1") and rendezvous.is_loopback("localhost")
    assert rendezvous.is_loopback("::1") and rendezvous.is_loopback("127.3.4.5")
    for host in ("0.0.0.0", "10.213.0.1", "192.0.2.7", "no-such-host.invalid"):
        assert not rendezvous.is_loopback(host), host
    assert rendezvous.secret_problem("127.0.0.1", None) is None
    assert rendezvous.secret_problem("10.0.0.1", SECRET) is None
    problem = rendezvous.secret_problem("10.0.0.1", None)
    assert (
        problem is not None and "ENGINE_RENDEZVOUS_SECRET" in problem and "--rendezvous_secret_file" in problem
    )
