"""The exit statuses a scheduler acts on (docs/several-machines.md#exit-statuses): engine.launch's
run ends with 2 for a bad input (never restarted), its task's own status where it has no
restarts, and RESTARTS_SPENT_EXIT (3) when it failed again after its restarts, so that Slurm or
Kubernetes does not retry what was retried already. The tasks here are small Python processes
that exit with a given status (no TensorFlow); the rendezvous's own case is in test_rendezvous.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.cluster import Cluster
from engine.errors import PEER_LOST_EXIT, RESTARTS_SPENT_EXIT, USER_ERROR_EXIT, final_status
from engine.launch.task_processes import Launcher, Task, cluster_spec


def exiting_tasks(spec: dict, statuses: dict[str, int]) -> list[Task]:
    """A task per address of `spec` that exits at once with `statuses[name]` (0 by default)."""
    tasks = []
    for task_type, addresses in spec.items():
        for index in range(len(addresses)):
            status = statuses.get(f"{task_type}:{index}", 0)
            code = f"import sys, time; time.sleep(0.1); sys.exit({status})"
            tasks.append(Task(Cluster(spec, task_type, index), [sys.executable, "-c", code]))
    return tasks


def run_launcher(statuses: dict[str, int], **options) -> tuple[int, list[str]]:
    spec = cluster_spec(2, 0, "localhost", [1, 2])
    said: list[str] = []
    launcher = Launcher(
        exiting_tasks(spec, statuses),
        new_training_tasks=lambda: exiting_tasks(spec, statuses),
        say=said.append,
        **options,
    )
    return launcher.run(), said


@pytest.mark.parametrize(
    "status, max_restarts, expected",
    [
        (PEER_LOST_EXIT, 0, PEER_LOST_EXIT),  # No restarts asked for: the task's own status.
        (1, 0, 1),
        (PEER_LOST_EXIT, 2, RESTARTS_SPENT_EXIT),  # Failed again after its two restarts.
        (1, 1, RESTARTS_SPENT_EXIT),
        (USER_ERROR_EXIT, 3, USER_ERROR_EXIT),  # Bad input: never restarted, always 2.
    ],
)
def test_a_launchers_status_tells_a_bad_input_a_failure_and_spent_restarts_apart(status, max_restarts, expected):
    code, said = run_launcher({"worker:1": status}, max_restarts=max_restarts)
    assert code == expected, said
    restarts = [line for line in said if line.startswith("restarting the cluster")]
    assert len(restarts) == (0 if status == USER_ERROR_EXIT else max_restarts), said
    if expected == RESTARTS_SPENT_EXIT:
        assert said[-1] == (
            f"worker:1 failed with exit status {status}; the {max_restarts} restart(s) of --max_restarts "
            "are spent; stopping the other tasks"
        ), said


def test_a_parameter_server_cluster_whose_worker_fails_past_its_restarts_ends_with_spent_restarts():
    spec = cluster_spec(1, 1, "localhost", [1, 2, 3])
    said: list[str] = []
    tasks = exiting_tasks(spec, {"worker:0": 1})
    for task in tasks:  # The chief and the ps task run on.
        if task.name != "worker:0":
            task.argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    launcher = Launcher(tasks, max_worker_restarts=1, say=said.append)
    try:
        assert launcher.run() == RESTARTS_SPENT_EXIT, said
    finally:
        launcher.stop(grace=1)
    assert said[-1] == (
        "worker:0 exited with status 1; the 1 restart(s) of --max_worker_restarts are spent; "
        "the cluster cannot go on, stopping it"
    ), said


def test_final_status_keeps_a_bad_inputs_2_and_a_status_without_restarts():
    assert final_status(2, "x", restarts=4, flag="--max_restarts") == (2, "x")
    assert final_status(143, "x", restarts=0, flag="--max_restarts") == (143, "x")
    assert final_status(69, "x", restarts=4, flag="--max_restarts") == (
        RESTARTS_SPENT_EXIT,
        "x; the 4 restart(s) of --max_restarts are spent",
    )


def test_the_documented_table_lists_every_status_of_engine_errors():
    """docs/several-machines.md#exit-statuses is what a scheduler's config is written from."""
    import re
    from pathlib import Path

    from engine import errors

    page = (Path(__file__).resolve().parents[3] / "docs" / "several-machines.md").read_text()
    table = page[page.index("## Exit statuses") :].split("\n## ", 1)[0]
    documented = {int(match) for match in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)}
    defined = {value for name, value in vars(errors).items() if name.endswith("_EXIT")}
    assert defined == {2, 3, 69, 75} and defined | {0, 1} == documented


def test_the_last_line_names_the_diagnostics_the_tasks_wrote_during_the_run(tmp_path):
    """A task that lost a peer (or got SIGUSR1) writes <model_dir>/diagnostics/<task>.txt; the
    launcher's last line says whose and where, leaving out reports of earlier runs."""
    import os
    import time

    from engine.launch.task_processes import diagnostics_written

    directory = tmp_path / "diagnostics"
    directory.mkdir()
    (directory / "worker-1.txt").write_text("an earlier run's")
    os.utime(directory / "worker-1.txt", (time.time() - 600, time.time() - 600))
    started = time.time() - 1
    assert diagnostics_written(str(tmp_path), started) == ""
    for task in ("worker-2", "worker-0"):
        (directory / f"{task}.txt").write_text("stacks")
    assert diagnostics_written(str(tmp_path), started) == f"; diagnostics of worker-0, worker-2 in {directory}"
    assert diagnostics_written(str(tmp_path / "elsewhere"), started) == ""
    assert diagnostics_written(None, started) == ""


def test_a_lost_input_server_ends_the_run_with_69_in_one_line():
    """engine.launch --data_workers: a data worker or the dispatcher gone (`lost_input`) ends the
    run as a lost peer does, the training tasks stopped (they save if they can)."""
    spec = cluster_spec(1, 0, "localhost", [1])
    tasks = [Task(Cluster(spec, "worker", 0), [sys.executable, "-c", "import time; time.sleep(60)"])]
    gone = "data_worker:0 (pid 7) of the tf.data service exited with signal 9; the training input is gone"
    said: list[str] = []
    launcher = Launcher(tasks, say=said.append, lost_input=lambda: gone)
    try:
        assert launcher.run() == PEER_LOST_EXIT
    finally:
        launcher.stop(grace=1)
    assert said[-1] == f"{gone}; stopping the training tasks (the latest checkpoint is kept), exit 69", said
    assert tasks[0].started.poll() is not None  # Stopped, nothing left running.


def test_a_data_worker_lost_while_others_serve_is_said_once_and_the_last_one_ends_the_input():
    from engine.launch.data_processes import DataService

    said: list[str] = []
    service = DataService(2, host="localhost", port=1, say=said.append)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for server in service.processes:  # Stand-ins for the dispatcher and the two data workers.
        server.process = subprocess.Popen(sleeper)
    try:
        assert service.lost() is None and said == []
        first = service.processes[2].process
        first.kill()
        first.wait()
        assert service.lost() is None and service.lost() is None
        assert said == [
            f"warning: data_worker:1 (pid {first.pid}) of the tf.data service exited with signal 9; the run "
            "goes on with the 1 data worker(s) left"
        ]
        last = service.processes[1].process
        last.kill()
        last.wait()
        assert service.lost() == (
            f"data_worker:0 (pid {last.pid}) of the tf.data service exited with signal 9; the training input is "
            "gone (no data worker left)"
        )
        dispatcher = service.processes[0].process
        dispatcher.terminate()
        dispatcher.wait()
        assert service.lost() == (
            f"dispatcher (pid {dispatcher.pid}) of the tf.data service exited with signal 15; the training "
            "input is gone"
        )
    finally:
        service.stop()
    assert all(server.exit_code() is not None for server in service.processes)
