"""Several machines: `engine.launch --nnodes=N --node_rank=I --rendezvous=HOST:PORT` run once on
each host, every host a network namespace with an address of its own on a virtual bridge
(tests/virtual_hosts.py), so nothing here can lean on localhost.

In one two-host run: a stranger on the network sends node 0's rendezvous garbage, a forged
join and a forged stop, and is kept out; then a frozen worker and a partitioned host both end
their round within the detection bound, and --max_restarts recovers the uninterrupted weights;
a host that never comes back leaves a cluster of three to go on with two (--min_nodes).
On loopback (no namespaces needed): nodes given other flags end before any task starts,
and SIGHUP to one node's launcher saves on every node.

Covers: engine/launch/node_launcher.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from helpers import (
    COMMAND_START,
    SMALL,
    free_ports,
    in_background,
    latest_step,
    model_weights,
    python_env,
    run_main,
)
from virtual_hosts import VirtualHosts

from engine.errors import PEER_LOST_EXIT

WHY_NOT = VirtualHosts.unavailable()
needs_hosts = pytest.mark.skipif(WHY_NOT is not None, reason=f"no virtual hosts: {WHY_NOT}")
RENDEZVOUS_PORT = 29400
LOST_WORKER_1 = r"worker:1 \(10\.213\.0\.2:\d+\) stopped answering"
HEARTBEAT_TIMEOUT = 10  # engine.main's default: the documented detection bound builds on it.
# The rendezvous listens on a bridge address, so the nodes must share a secret.
SECRET = {"ENGINE_RENDEZVOUS_SECRET": "d5e0c0bd1a7f4f2a9e3b6c8d0f1a2b3c"}


# One run for every test here, short and one step a call: the float differences of a changed
# reduction order (three workers, then two) stay at 1e-7, where over a thousand steps of this
# noisy task they grow chaotically. 250 steps still leave seconds to freeze, cut or kill a host
# (the cut comes at step ~150, some 100 steps before the end); at one step a call, the 150 steps
# fewer than 400 saved 13-16 CPU-s in each two- and three-host test (measured with --profile-suite).
STEPS = 250
FLAGS = [
    *SMALL,
    "--global_batch_size=48",
    "--steps_per_loop=1",
    "--checkpoint_every=20",
    f"--train_steps={STEPS}",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The one-process run every cluster here must end equal to (started once, in the background)."""
    model_dir = tmp_path_factory.mktemp("uninterrupted")
    run = in_background(run_main, "--strategy=default", *FLAGS, f"--model_dir={model_dir}", timeout=400)
    return run, model_dir


def assert_equal_to_uninterrupted(model_dir, uninterrupted) -> None:
    run, reference_dir = uninterrupted
    assert run.result().returncode == 0, run.result().stderr[-3000:]
    assert_equal_weights(model_dir, reference_dir, STEPS)


def start_nodes(launch, hosts: VirtualHosts, launcher_flags: list[str], main_flags: list[str], nodes=None):
    """engine.launch on each host (node 0 serves the rendezvous at its own address)."""
    rendezvous = f"{hosts.addresses[0]}:{RENDEZVOUS_PORT}"
    started = []
    for rank in nodes if nodes is not None else range(len(hosts.names)):
        started.append(
            launch(
                f"--nnodes={len(hosts.names)}",
                f"--node_rank={rank}",
                f"--rendezvous={rendezvous}",
                *launcher_flags,
                "--",
                "--strategy=multi_worker_mirrored",
                *main_flags,
                inside=hosts.command(rank),
                env=SECRET,
            )
        )
    return started


def assert_equal_weights(model_dir, reference_dir, step: int) -> None:
    multi, single = model_weights(model_dir, step), model_weights(reference_dir, step)
    assert multi.keys() == single.keys() and multi
    for name in multi:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)


# A stranger on host 1's network, before node 1 starts: what used to kill node 0's rendezvous
# thread, take rank 1 (and the cluster spec), or end the run with exit 0 having trained nothing.
STRANGER = r"""
import json, socket, sys, time
from engine.launch.rendezvous import PROTOCOL, RendezvousClient

host, port = sys.argv[1], int(sys.argv[2])
def frame(body):
    data = json.dumps(body).encode()
    return len(data).to_bytes(4, "big") + data
deadline = time.monotonic() + 120
while True:  # node 0 may not serve yet
    try:
        socket.create_connection((host, port), timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("no rendezvous to attack")
        time.sleep(0.2)
hello = frame({"kind": "hello", "protocol": PROTOCOL, "nonce": "00" * 32})
sent = [
    b"[" * 100000 + b"\n",
    b'{"kind": "join", "rank": 1, "ports": [29999], "host": "10.213.0.2"}\n',
    b'{"kind": "stop", "status": 0, "cause": "forged"}\n',
    frame({"kind": "join", "rank": 1, "ports": [29999], "host": "10.213.0.2"}),
    hello + frame({"kind": "proof", "proof": "00" * 32}) + frame({"kind": "stop", "status": 0, "cause": "x"}),
]
answers = []
for data in sent:
    got = b""
    with socket.create_connection((host, port), timeout=5) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                got += chunk
        except OSError:
            pass
    answers.append(got.decode("latin-1"))
wrong = RendezvousClient((host, port), heartbeat_timeout=5, secret=b"not the run's secret, 32 bytes!")
print(json.dumps({"answers": answers, "admitted": wrong.connect(time.monotonic() + 1)}))
"""


@needs_hosts
@pytest.mark.timeout(600)
def test_two_hosts_keep_a_stranger_out_and_end_a_round_on_a_frozen_worker_or_a_cut_host_then_recover(
    tmp_path, launch, uninterrupted
):
    """One two-host run for three things (each two-host run costs half a minute of both cores):
    a stranger on host 1's network attacks node 0's rendezvous before node 1 starts; then a
    worker is frozen, then a host cut off, each ending its round within the detection bound;
    --max_restarts recovers, and the run ends equal to one process."""
    launcher_flags = ["--max_restarts=2"]
    flags = [*FLAGS, f"--model_dir={tmp_path / 'two'}", "--log_all_tasks"]
    with VirtualHosts(2) as hosts:
        [first] = start_nodes(launch, hosts, launcher_flags, flags, nodes=[0])
        stranger = subprocess.run(
            hosts.python(1, "-c", COMMAND_START + STRANGER, hosts.addresses[0], str(RENDEZVOUS_PORT)),
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=150,
        )
        [second] = start_nodes(launch, hosts, launcher_flags, flags, nodes=[1])
        # A frozen worker: alive, its host reachable, silent.
        first.wait_for(r"\[worker:0\].*step \d*[1-9]\d\d/", timeout=300)  # past step 100
        worker = int(second.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
        os.kill(worker, signal.SIGSTOP)
        frozen = time.monotonic()
        first.wait_for(
            rf"\[launch node 0\] {LOST_WORKER_1} .*\(worker:0 exited with status 69\)",
            60,
        )
        freeze_detected = time.monotonic() - frozen
        second.wait_for(r"restarting the cluster \(1/2\)", timeout=60)

        # A partitioned host: its link down once the second round trains past its restore.
        first.wait_for(r"\[launch node 0\] round with node\(s\) 0, 1", timeout=1)
        restored = first.wait_for(r"\[worker:0\].*steps=(\d+)->", timeout=300)
        resumed_at = int(restored.group(1))
        marker = len(first.lines)
        wait_for_step_after(first, marker, resumed_at + 40, timeout=300)
        hosts.partition(1)
        partitioned = time.monotonic()
        wait_after(first, marker, r"restarting the cluster \(2/2\)", timeout=90)
        partition_detected = time.monotonic() - partitioned
        hosts.heal(1)
        codes = [first.wait(timeout=400), second.wait(timeout=60)]
        assert codes == [0, 0], first.output[-3000:] + second.output[-3000:]

    # The stranger: never admitted, never answered more than the handshake's challenge (and `rejected`).
    assert stranger.returncode == 0, stranger.stderr[-3000:]
    seen = json.loads(stranger.stdout)
    assert not seen["admitted"]
    assert all(not re.search("round|spec|end|worker", answer) for answer in seen["answers"]), seen
    dropped = [line for line in first.lines if line.startswith("[launch node 0] warning: dropped a connection")]
    assert len(dropped) >= 3 and all("from 10.213.0.2: " in line for line in dropped), first.output[-3000:]
    for rank, node in enumerate([first, second]):  # Each task at its own host's address, never localhost.
        node.wait_for(rf"started worker:{rank} \(pid \d+\) at 10\.213\.0\.{rank + 1}:\d+", timeout=1)
        node.wait_for(rf"\[worker:{rank}\].*done: step {STEPS}", timeout=1)
        node.wait_for(r"round with node\(s\) 0, 1: 2 worker\(s\)", timeout=1)  # the stranger took no rank
        assert "Traceback" not in node.output, node.output[-3000:]

    # The frozen worker and the cut host.
    print(
        f"detected: a frozen worker in {freeze_detected:.1f} s, a partitioned host in {partition_detected:.1f} s"
    )
    bound = HEARTBEAT_TIMEOUT + 10  # README, several machines: the heartbeat timeout + a few seconds
    assert freeze_detected < bound and partition_detected < bound, (freeze_detected, partition_detected)
    # Each lost peer is one line of worker:0's own, never a traceback.
    errors = [line for line in first.lines if line.startswith("[worker:0] engine.main: error:")]
    assert len(errors) == 2 and all(re.search(LOST_WORKER_1, line) for line in errors), errors
    # Its report of where it was when the peer went, and the launcher's last line says where.
    [last] = [line for line in first.lines if line.startswith("[launch node 0] done with exit status 0")]
    assert "; diagnostics of worker-0" in last and str(tmp_path / "two" / "diagnostics") in last, last
    assert_equal_to_uninterrupted(tmp_path / "two", uninterrupted)


@needs_hosts
@pytest.mark.timeout(600)
def test_three_hosts_go_on_as_two_when_one_does_not_come_back(tmp_path, launch, uninterrupted):
    with VirtualHosts(3) as hosts:
        nodes = start_nodes(
            launch,
            hosts,
            ["--max_restarts=1", "--min_nodes=2", "--rejoin_timeout=5"],
            [*FLAGS, f"--model_dir={tmp_path / 'three'}"],
        )
        nodes[0].wait_for(r"\[worker:0\] Saved checkpoint .*ckpt-40$", timeout=300)
        nodes[2].kill_all()  # The host is gone: its launcher and worker with it.
        lost = time.monotonic()
        nodes[0].wait_for(r"restarting the cluster \(1/1\): node 2 left the rendezvous", timeout=60)
        nodes[0].wait_for(r"round with node\(s\) 0, 1: 2 worker\(s\)", timeout=120)
        waited = time.monotonic() - lost
        resumed = int(nodes[0].wait_for(r"\[worker:0\] Restored .*ckpt-(\d+) at step", timeout=120).group(1))
        nodes[0].wait_for(r"\[worker:0\] strategy=multi_worker_mirrored  replicas=2 ", 1)
        nodes[0].wait_for(r"\[worker:0\] global_batch=48  per_replica_batch=24 ", 1)
        codes = [node.wait(timeout=400) for node in nodes[:2]]
        assert codes == [0, 0], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    assert 40 <= resumed < STEPS and waited >= 5  # it waited out --rejoin_timeout for node 2 first
    # The same global batch (48 = 3 x 16 = 2 x 24) and data position: only the reduction order changed.
    assert_equal_to_uninterrupted(tmp_path / "three", uninterrupted)


def wait_after(launched, start: int, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in launched.lines[start:]:
            match = re.search(pattern, line)
            if match:
                return match
        time.sleep(0.1)
    raise AssertionError(f"no line matches {pattern!r}:\n{launched.output[-4000:]}")


def wait_for_step_after(launched, start: int, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in launched.lines[start:]:
            match = re.search(r"\[worker:0\].*step (\d+)/", line)
            if match and int(match.group(1)) >= step:
                return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} after the restart:\n{launched.output[-4000:]}")


@pytest.mark.timeout(120)
def test_a_node_that_never_arrives_ends_the_start_up_with_one_line_naming_it(launch):
    port = free_ports(1)[0]
    began = time.monotonic()
    node = launch(
        "--nnodes=3",
        "--node_rank=0",
        f"--rendezvous=127.0.0.1:{port}",
        "--",
        "--strategy=multi_worker_mirrored",
        *SMALL,
        "--startup_timeout=3",
        "--model_dir=/nonexistent/never-written",
    )
    assert node.wait(timeout=60) == PEER_LOST_EXIT, node.output  # Unavailable peers: a rerun may find them.
    took = time.monotonic() - began
    ended = [line for line in node.lines if "the run ended" in line]
    assert ended == [
        f"[launch node 0] the run ended with exit status 69: node(s) 1, 2 of --nnodes=3 never joined the "
        f"rendezvous at 127.0.0.1:{port} within 3 s (--startup_timeout): start engine.launch with their "
        "--node_rank there, or check that they reach this address"
    ], node.output
    assert "started worker" not in node.output and took < 60


def loopback_nodes(launch, launcher_flags: list[str], per_node: list[list[str]]) -> list:
    """engine.launch for each node on this machine, the rendezvous on loopback (no secret needed)."""
    port = free_ports(1)[0]
    return [
        launch(
            f"--nnodes={len(per_node)}",
            f"--node_rank={rank}",
            f"--rendezvous=127.0.0.1:{port}",
            *launcher_flags,
            "--",
            "--strategy=multi_worker_mirrored",
            *flags,
        )
        for rank, flags in enumerate(per_node)
    ]


@pytest.mark.timeout(120)
def test_nodes_given_other_flags_end_before_any_task_starts_naming_them(tmp_path, launch):
    flags = [*SMALL, "--train_steps=20", f"--model_dir={tmp_path}"]
    nodes = loopback_nodes(launch, [], [flags, [*flags, "--learning_rate=0.01"]])
    assert [node.wait(timeout=60) for node in nodes] == [2, 2], nodes[0].output + nodes[1].output
    line = (
        "the run ended with exit status 2: node 1's --learning_rate=0.01 differs from node 0's "
        "--learning_rate=0.1; give every node the same flags after --"
    )
    for rank, node in enumerate(nodes):
        assert [text for text in node.lines if "the run ended" in text] == [f"[launch node {rank}] {line}"]
        assert "started worker" not in node.output and "Traceback" not in node.output
    assert not tmp_path.joinpath("checkpoints").exists()


@pytest.mark.timeout(300)
def test_sighup_to_one_nodes_launcher_saves_on_every_node_at_one_step(tmp_path, launch):
    flags = [
        *SMALL,
        "--train_steps=100000",
        "--steps_per_loop=10",
        "--checkpoint_every=100000",
        f"--model_dir={tmp_path}",
    ]
    nodes = loopback_nodes(launch, [], [flags, flags])
    nodes[0].wait_for(r"\[worker:0\].*step \d+/100000", timeout=240)
    os.kill(nodes[1].process.pid, signal.SIGHUP)  # node 1's ssh session closed
    sent = time.monotonic()
    codes = [node.wait(timeout=150) for node in nodes]
    took = time.monotonic() - sent
    assert codes == [129, 129], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    stopped = [
        int(node.wait_for(rf"\[worker:{rank}\].*stopped at step (\d+) by signal 1;", timeout=1).group(1))
        for rank, node in enumerate(nodes)
    ]
    assert stopped[0] == stopped[1] == latest_step(tmp_path) and stopped[0] > 0, stopped
    nodes[0].wait_for(r"\[launch node 0\] the run ended with exit status 129: node 1 received SIGHUP", timeout=1)
    assert not list(tmp_path.rglob("*_temp")) and not tmp_path.joinpath(".writer.lock").exists()
    assert all("Traceback" not in node.output for node in nodes) and took < 60, took
