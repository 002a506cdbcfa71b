"""Several machines: `engine.launch --nnodes=N --node_rank=I --rendezvous=HOST:PORT` run once on
each host, every host a network namespace with an address of its own on a virtual bridge
(tests/virtual_hosts.py), so nothing here can lean on localhost.

Two hosts equal one process; a frozen worker and a partitioned host both end their round
within the detection bound and --max_restarts recovers the uninterrupted weights; a host
that never comes back leaves a cluster of three to go on with two (--min_nodes)."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
from helpers import SMALL, free_ports, in_background, model_weights, run_main
from virtual_hosts import VirtualHosts

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

WHY_NOT = VirtualHosts.unavailable()
needs_hosts = pytest.mark.skipif(WHY_NOT is not None, reason=f"no virtual hosts: {WHY_NOT}")
RENDEZVOUS_PORT = 29400
LOST_WORKER_1 = r"worker:1 \(10\.213\.0\.2:\d+\) stopped answering"
HEARTBEAT_TIMEOUT = 10  # engine.main's default: the documented detection bound builds on it.


# One run for every test here, short and one step a call: the float differences of a changed
# reduction order (three workers, then two) stay at 1e-7, where over a thousand steps of this
# noisy task they grow chaotically; 400 steps still leave seconds to freeze, cut or kill a host.
STEPS = 400
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
            )
        )
    return started


def assert_equal_weights(model_dir, reference_dir, step: int) -> None:
    multi, single = model_weights(model_dir, step), model_weights(reference_dir, step)
    assert multi.keys() == single.keys() and multi
    for name in multi:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)


@needs_hosts
@pytest.mark.timeout(400)
def test_two_hosts_equal_one_process(tmp_path, launch, uninterrupted):
    with VirtualHosts(2) as hosts:
        nodes = start_nodes(launch, hosts, [], [*FLAGS, f"--model_dir={tmp_path / 'two'}"])
        codes = [node.wait(timeout=300) for node in nodes]
        assert codes == [0, 0], "\n".join(node.output[-3000:] for node in nodes)
    for rank, node in enumerate(nodes):  # Each task at its own host's address, never localhost.
        node.wait_for(rf"started worker:{rank} \(pid \d+\) at 10\.213\.0\.{rank + 1}:\d+", timeout=1)
        node.wait_for(rf"\[worker:{rank}\].*done: step {STEPS}", timeout=1)
    assert_equal_to_uninterrupted(tmp_path / "two", uninterrupted)


@needs_hosts
@pytest.mark.timeout(600)
def test_a_frozen_worker_and_a_partitioned_host_end_their_round_and_restarts_recover(
    tmp_path, launch, uninterrupted
):
    with VirtualHosts(2) as hosts:
        first, second = start_nodes(
            launch, hosts, ["--max_restarts=2"], [*FLAGS, f"--model_dir={tmp_path / 'two'}", "--log_all_tasks"]
        )
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
    print(
        f"detected: a frozen worker in {freeze_detected:.1f} s, a partitioned host in {partition_detected:.1f} s"
    )
    bound = HEARTBEAT_TIMEOUT + 10  # README, several machines: the heartbeat timeout + a few seconds
    assert freeze_detected < bound and partition_detected < bound, (freeze_detected, partition_detected)
    # Each lost peer is one line of worker:0's own, never a traceback.
    errors = [line for line in first.lines if line.startswith("[worker:0] engine.main: error:")]
    assert len(errors) == 2 and all(re.search(LOST_WORKER_1, line) for line in errors), errors
    assert "Traceback" not in first.output, first.output[-3000:]
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
        nodes[0].wait_for(
            r"\[worker:0\] strategy=multi_worker_mirrored replicas=2 .*global_batch=48 per_replica_batch=24", 1
        )
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
    assert node.wait(timeout=60) == 1, node.output
    took = time.monotonic() - began
    ended = [line for line in node.lines if "the run ended" in line]
    assert ended == [
        f"[launch node 0] the run ended with exit status 1: node(s) 1, 2 of --nnodes=3 never joined the "
        f"rendezvous at 127.0.0.1:{port} within 3 s (--startup_timeout): start engine.launch with their "
        "--node_rank there, or check that they reach this address"
    ], node.output
    assert "started worker" not in node.output and took < 60
