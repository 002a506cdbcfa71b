"""The multi-host launcher's rendezvous (engine.cluster.rendezvous), with clients in this process:
who is in a round, when a round restarts, shrinks or ends, and the one line of each end."""

from __future__ import annotations

import time

import pytest
from helpers import free_ports

from engine.cluster.rendezvous import RendezvousClient, RendezvousServer, parse_address


def serve(nnodes: int, **options) -> RendezvousServer:
    settings = dict(
        nnodes=nnodes,
        min_nodes=nnodes,
        max_restarts=0,
        startup_timeout=20.0,
        rejoin_timeout=20.0,
        heartbeat_timeout=10.0,
    )
    settings.update(options)
    return RendezvousServer(("127.0.0.1", free_ports(1)[0]), **settings).start()


def join(server: RendezvousServer, rank: int, ports: list[int]) -> RendezvousClient:
    host, port = server.address_text.rsplit(":", 1)
    client = RendezvousClient((host, int(port)), heartbeat_timeout=10.0)
    assert client.connect(time.monotonic() + 10)
    client.send("join", rank=rank, ports=ports, host=None)
    return client


def next_message(client: RendezvousClient, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = client.poll(0.1)
        if messages:
            return messages[0]
    raise AssertionError("no message from the rendezvous")


def test_a_round_gives_every_node_every_address_in_rank_order():
    server = serve(2)
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
    assert [(m["kind"], m["status"], m["reason"]) for m in ends] == [
        ("end", 1, "worker:0 exited with status 1")
    ] * 2


def test_bad_flags_are_never_restarted():
    server = serve(2, max_restarts=5)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    [next_message(client) for client in clients]
    clients[0].send("failed", cause="worker:0 exited with status 2", status=2)
    assert next_message(clients[1])["kind"] == "end" and server.status == 2


def test_a_node_that_never_joins_ends_the_start_up_naming_it():
    server = serve(3, startup_timeout=1.0)
    client = join(server, 0, [6000])
    message = next_message(client)
    assert message["kind"] == "end" and message["status"] == 1
    assert message["reason"].startswith("node(s) 1, 2 of --nnodes=3 never joined the rendezvous at 127.0.0.1:")
    assert "within 1 s (--startup_timeout)" in message["reason"]


def test_a_cluster_shrinks_to_the_nodes_that_come_back_within_the_rejoin_window():
    server = serve(3, min_nodes=2, max_restarts=1, rejoin_timeout=1.0)
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
    assert time.monotonic() - began >= 0.9  # it waited for node 2 first
    assert [m["kind"] for m in rounds] == ["round", "round"]
    assert rounds[0]["spec"] == {"worker": ["127.0.0.1:6100", "127.0.0.1:6101"]} and rounds[0]["nodes"] == [0, 1]


def test_too_few_nodes_back_end_the_run_naming_the_missing_ones():
    server = serve(3, min_nodes=3, max_restarts=2, startup_timeout=1.0)
    clients = [join(server, rank, [6000 + rank]) for rank in range(3)]
    [next_message(client) for client in clients]
    clients[1].send("failed", cause="worker:1 exited with signal 9", status=137)
    [next_message(client) for client in clients]
    for client in clients:
        client.close()
    clients = [join(server, rank, [6100 + rank]) for rank in (0, 2)]
    message = next_message(clients[0])
    assert message["kind"] == "end" and message["status"] == 1
    assert (
        message["reason"] == "node(s) 1 did not come back within 1 s and 2 node(s) are fewer than --min_nodes=3"
    )


def test_a_node_that_falls_silent_fails_its_round():
    server = serve(2, max_restarts=1, heartbeat_timeout=1.5)
    clients = [join(server, rank, [6000 + rank]) for rank in (0, 1)]
    [next_message(client) for client in clients]
    began = time.monotonic()
    # Node 1 stops answering: its client is never polled again, so it sends no beat.
    message = next_message(clients[0], timeout=10)
    assert message == {**message, "kind": "restart", "cause": "node 1 stopped answering the rendezvous"}
    assert time.monotonic() - began < 1.5 + 2


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
