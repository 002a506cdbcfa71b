"""engine.launch refuses numbers it cannot count, its own and those after `--` that every
engine.main task would die of, with one line naming the flag and exit 2, before it starts a
task. In-process: absl parses the flags and `launch.main` checks them (no task starts).

Covers: engine/launch/launcher.py.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from unittest import mock

import pytest
from absl import flags
from helpers import environment

from engine.launch import launcher as launch
from engine.launch import node_launcher, rendezvous

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
    (
        ["--nnodes=2", "--rendezvous=10.0.0.1:29400", "--"],
        "engine.launch: error: the rendezvous at 10.0.0.1 is reachable from other machines, so the run's "
        "nodes must share a secret: export ENGINE_RENDEZVOUS_SECRET or pass --rendezvous_secret_file=FILE",
    ),
    (
        ["--nnodes=2", "--rendezvous=0.0.0.0:29400", "--node_rank=0", "--"],
        "the rendezvous at 0.0.0.0 is reachable from other machines",
    ),
    (
        ["--nnodes=2", "--rendezvous=127.0.0.1:29400", "--rendezvous_secret_file=/nonexistent/secret", "--"],
        "--rendezvous_secret_file=/nonexistent/secret: cannot read it (No such file or directory)",
    ),
    (
        ["--nnodes=2", "--rendezvous=127.0.0.1:29400", "--advertise_host=a b", "--"],
        "--advertise_host='a b' must be a host name or an IP address",
    ),
    (["--nnodes=0", "--"], "--nnodes=0 must be between 1 and 1024"),
    (["--nnodes=2", "--workers_per_node=0", "--"], "--workers_per_node=0 must be between 1 and 1024"),
    # --data_workers: a tf.data service started here, for one host's multi_worker_mirrored tasks.
    (["--data_workers=-1", "--"], "--data_workers=-1 must be between 0 and 1024"),
    (
        ["--data_workers=1", "--", "--data_service=grpc://h:1"],
        "--data_workers=1 starts a tf.data service here and passes its address; drop "
        "--data_service=grpc://h:1 after --",
    ),
    (["--data_workers=1", "--num_ps=1", "--"], "--data_workers feeds multi_worker_mirrored tasks"),
    (
        ["--data_workers=1", "--nnodes=2", "--rendezvous=node0:1", "--"],
        "with --nnodes > 1 start python -m engine.data_service on the input hosts",
    ),
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
        ["--num_workers=16", "--", "--dry_run"],
        "--dry_run checks a cluster's config on this machine alone, without a cluster: run "
        "python -m engine.main --dry_run --dry_run_workers=16 ...",
    ),
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
        environment({"ENGINE_RENDEZVOUS_SECRET": None}),
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


SECRET = "0123456789abcdef0123456789abcdef"


def node_launcher_arguments(*argv: str) -> tuple[tuple, dict]:
    """What engine.launch hands NodeLauncher for ARGV (with a secret in the environment)."""
    with (
        environment({"ENGINE_RENDEZVOUS_SECRET": SECRET}),
        mock.patch.object(node_launcher, "NodeLauncher") as made,
    ):
        made.return_value.run.return_value = 0
        try:
            assert launch.main(launch.parse_flags(["engine.launch", *argv])) == 0
        finally:
            flags.FLAGS.unparse_flags()
    return made.call_args


@pytest.mark.cli
def test_each_node_sends_the_flags_that_must_be_equal_and_not_its_own(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.5\n")
    common = ["--nnodes=2", "--rendezvous=10.0.0.1:29400", "--"]
    main = ["--strategy=multi_worker_mirrored", "--model=mlp", "--train_steps=400", f"--config_file={config}"]
    args, kwargs = node_launcher_arguments(
        "--node_rank=0", *common, *main, "--model_dir=/a", "--learning_rate=1e-1"
    )
    assert kwargs["secret"] == SECRET.encode()
    node0 = kwargs["settings"]
    _, kwargs = node_launcher_arguments(
        "--node_rank=1",
        "--advertise_host=10.0.0.2",
        *common,
        *main,
        "--model_dir=/mnt/a",
        "--learning_rate=0.01",
    )
    node1 = kwargs["settings"]
    # The per-node settings are left out (model_dir, the timeouts, the cluster), the rest compared.
    assert rendezvous.settings_difference(1, node1, node0) == (
        "node 1's --learning_rate=0.01 differs from node 0's --learning_rate=0.1; "
        "give every node the same flags after --"
    )
    assert node0["model"] == "mlp" and node0["train_steps"] == "400" and node0["seed"] == "42"
    assert node0["engine.launch workers_per_node"] == "1" and node0["engine.launch nnodes"] == "2"
    assert not {"model_dir", "startup_timeout", "task_index", "worker_hosts", "log_all_tasks"} & set(node0)
    # A config file counts by its contents too: the same path with other contents differs.
    config.write_text("learning_rate: 0.7\n")
    _, kwargs = node_launcher_arguments("--node_rank=1", *common, *main, "--model_dir=/a", "--learning_rate=0.1")
    difference = rendezvous.settings_difference(1, kwargs["settings"], node0)
    assert difference is not None and difference.startswith(f"node 1's --config_file={config} (sha256 ")


@pytest.mark.cli
def test_the_secret_is_optional_on_loopback():
    with environment({"ENGINE_RENDEZVOUS_SECRET": None}):
        with mock.patch.object(node_launcher, "NodeLauncher") as made:
            made.return_value.run.return_value = 0
            try:
                launch.main(
                    launch.parse_flags(["engine.launch", "--nnodes=2", "--rendezvous=127.0.0.1:29400", "--"])
                )
            finally:
                flags.FLAGS.unparse_flags()
    assert made.call_args.kwargs["secret"] is None
