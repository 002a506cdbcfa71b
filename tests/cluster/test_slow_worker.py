"""The straggler report (engine.stragglers) on a real two-worker cluster with one worker slowed
on purpose by a CPU quota (a cgroup's, as a throttled VM or container has) once both train. The
chief's line names that worker and no other; metrics.json and TensorBoard hold both workers'
compute time and input wait per step."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_ports, read_scalars, wait_for_text

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
PERIOD_US, QUOTA_US = 100_000, 10_000  # A tenth of one CPU


@contextlib.contextmanager
def cpu_quota(pid: int) -> Iterator[None]:
    """Holds process `pid` (all its threads) to QUOTA_US of CPU time per PERIOD_US in a cgroup of
    its own (cgroup v1's cpu controller, as root); undone and the cgroup removed at the end.
    (Stopping and continuing the process instead, 9/10 of each 50 ms, lost its heartbeats.)"""
    group = CPU_CGROUPS / f"engine-test-{os.getpid()}-{pid}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"no cpu cgroup to hold a worker to a quota in: {error}")
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for left in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUPS / "cgroup.procs").write_text(left)
        group.rmdir()


@pytest.mark.timeout(600)
def test_a_worker_held_to_a_cpu_quota_is_named_and_no_other(tmp_path, workers):
    hosts = ",".join(f"localhost:{port}" for port in free_ports(2))
    model_dir = tmp_path / "run"
    common = [
        "--strategy=multi_worker_mirrored",
        "--model=cnn",
        "--train_steps=60",
        "--steps_per_loop=5",
        "--straggler_loops=3",
        "--device_data_mb=0",  # Batches through a tf.data iterator, whose waits are timed too.
        "--mode=train",
        f"--worker_hosts={hosts}",
        "--task_type=worker",
        f"--model_dir={model_dir}",
    ]
    chief, chief_log = workers(*common, "--task_index=0")
    slowed, slowed_log = workers(*common, "--task_index=1")
    wait_for_text(
        chief_log, r"step 5/60 ", chief, timeout=300
    )  # Started at full speed (a tenth would take minutes).
    with cpu_quota(slowed.pid):
        assert chief.wait(timeout=450) == 0, chief_log.read_text()[-3000:]
        assert slowed.wait(timeout=60) == 0, slowed_log.read_text()[-3000:]
    output = chief_log.read_text()
    named = [line for line in output.splitlines() if "the median step time of the others" in line]
    # Named once, and again only if it caught up for a loop and fell behind anew; worker:0 never.
    assert named, output[-3000:]
    for line in named:
        assert re.fullmatch(
            r"warning: worker:1 \(localhost\) [0-9.]+x the median step time of the others for 3 loops "
            r"\([0-9.]+ ms against [0-9.]+ ms: compute [0-9.]+ ms, input wait [0-9.]+ ms\)",
            line,
        ), named
    record = json.loads((model_dir / "metrics.json").read_text())
    seconds, waits = record["compute_seconds_per_step"], record["input_wait_seconds_per_step"]
    assert set(seconds) == set(waits) == {"worker:0", "worker:1"}
    assert seconds["worker:1"] >= 1.5 * seconds["worker:0"] > 0, seconds
    assert all(0 < wait < seconds["worker:1"] for wait in waits.values()), (
        waits
    )  # Timed; the compute held it up.
    scalars = read_scalars(model_dir / "train")
    charts = {tag: values for tag, values in scalars.items() if "seconds_per_step/" in tag}
    assert set(charts) == {
        f"{figure}_seconds_per_step/worker_{index}" for figure in ("compute", "input_wait") for index in (0, 1)
    }
    assert len(charts["compute_seconds_per_step/worker_1"]) >= 3  # A point per loop.
