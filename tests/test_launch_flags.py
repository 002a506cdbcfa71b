"""engine.launch refuses numbers it cannot count, its own and those after `--` that every
engine.main task would die of, with one line naming the flag and exit 2, before it starts a
task. In-process: absl parses the flags and `launch.main` checks them (no task starts)."""

from __future__ import annotations

import contextlib
import io
import subprocess
from unittest import mock

import pytest
from absl import flags

from engine.cli import launcher as launch
from engine.cli import node_launcher

ONE_LAUNCHER = f"one launcher starts at most {launch.MAX_TASKS}"
CASES = [
    *[
        (["--num_workers=" + value, "--"], f"flag --num_workers={value}: invalid literal")
        for value in ("nan", "inf")
    ],
    (["--num_ps=-inf", "--"], "flag --num_ps=-inf: invalid literal"),
    (["--max_restarts=nan", "--"], "flag --max_restarts=nan: invalid literal"),
    (["--max_worker_restarts=1e3", "--"], "flag --max_worker_restarts=1e3: invalid literal"),
    (["--num_workers=0", "--"], "--num_workers=0 must be between 1 and 1024"),
    (
        ["--num_workers=1025", "--"],
        "--num_workers=1025 must be between 1 and 1024 (the tasks one launcher starts",
    ),
    (["--num_workers=1000000000", "--"], "--num_workers=1000000000 must be between 1 and 1024"),
    (["--num_ps=1025", "--"], "--num_ps=1025 must be between 0 and 1024"),
    (["--num_ps=-1", "--"], "--num_ps=-1 must be between 0 and 1024"),
    (
        ["--num_workers=1000", "--num_ps=24", "--"],
        f"--num_workers=1000 --num_ps=24 make 1025 tasks; {ONE_LAUNCHER}",
    ),
    (["--num_workers=1024", "--evaluator", "--"], "--num_workers=1024 --num_ps=0 --evaluator make 1025 tasks"),
    (["--max_restarts=2147483648", "--"], "--max_restarts=2147483648 must be between 0 and 2147483647"),
    (["--max_worker_restarts=-1", "--"], "--max_worker_restarts=-1 must be between 0 and 2147483647"),
    # Several machines: each node's own flags.
    (["--nnodes=2", "--"], "--nnodes=2 needs --rendezvous=HOST:PORT, node 0's address that every node reaches"),
    (["--nnodes=2", "--rendezvous=node0", "--"], "--rendezvous=node0: 'node0' is not HOST:PORT"),
    (
        ["--nnodes=2", "--rendezvous=node0:1", "--node_rank=2", "--"],
        "--node_rank=2 must be from 0 to --nnodes-1=1",
    ),
    (
        ["--nnodes=2", "--rendezvous=node0:1", "--min_nodes=3", "--"],
        "--min_nodes=3 must be from 1 to --nnodes=2",
    ),
    (["--nnodes=2", "--rendezvous=node0:1", "--rejoin_timeout=nan", "--"], "--rejoin_timeout=nan must be 0 to"),
    (["--nnodes=2", "--rendezvous=node0:1", "--num_ps=1", "--"], "--nnodes > 1 launches multi_worker_mirrored"),
    (["--nnodes=0", "--"], "--nnodes=0 must be between 1 and 1024"),
    (["--nnodes=2", "--workers_per_node=0", "--"], "--workers_per_node=0 must be between 1 and 1024"),
    # engine.main's numbers, which every task would die of after the cluster started.
    (
        ["--", "--startup_timeout=inf"],
        "engine.main would refuse the flags after --: --startup_timeout=inf must be a",
    ),
    (["--", "--collective_timeout=nan"], "--collective_timeout=nan must be a finite number (0 waits forever)"),
    (["--", "--collective_timeout=1e10"], "--collective_timeout=1e+10 is beyond the longest timeout"),
    (["--", "--slurm_port_base=65536"], "--slurm_port_base=65536 must be a port, 1-65535"),
    (["--", "--steps_per_loop=3000000000"], "--steps_per_loop=3000000000 is more than the engine can count"),
    (
        ["--", "--train_stepz=3"],
        "the flags after -- are not engine.main's: Unknown command line flag 'train_stepz'",
    ),
]


def launch_in_process(*argv: str, open_files: int = 65536) -> subprocess.CompletedProcess:
    """`python -m engine.launch ARGV` up to its checks (a launch that passes them would start
    tasks) under `ulimit -n open_files`: the host's own limit would change the task limit."""
    stderr = io.StringIO()
    with (
        contextlib.redirect_stderr(stderr),
        mock.patch.object(launch, "Launcher", side_effect=AssertionError),
        mock.patch.object(node_launcher, "NodeLauncher", side_effect=AssertionError),
        mock.patch.object(launch.resource, "getrlimit", return_value=(open_files, open_files)),
    ):
        try:
            code = launch.main(launch.parse_flags(["engine.launch", *argv]))
        except SystemExit as exited:
            code = exited.code
        finally:
            flags.FLAGS.unparse_flags()
    return subprocess.CompletedProcess(["engine.launch", *argv], code, "", stderr.getvalue())


@pytest.mark.cli
@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_a_launcher_number_it_cannot_count_is_one_line_naming_the_flag(argv, message):
    result = launch_in_process(*argv)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("engine.launch: error: ") and message in lines[0], lines[0]
    assert "started" not in result.stderr


@pytest.mark.cli
def test_few_open_files_lower_the_task_limit():
    result = launch_in_process("--num_workers=100", "--", open_files=256)
    assert result.returncode == 2
    assert "--num_workers=100 must be between 1 and 96 (the tasks one launcher starts here" in result.stderr
