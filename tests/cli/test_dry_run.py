"""`engine.main --dry_run`: a cluster's config checked on one machine, nothing written.

Checked against what a real run does: the simulated step's loss is a real run's first loss
(one global batch's mean, whatever the replicas), the checkpoint size what a real run's
checkpoint holds on disk, and each problem one line with exit 2 while the model_dir stays
byte for byte as it was. In-process (`helpers.main_in_process`): the test session has two
CPU devices, so 16 simulated replicas run their step on 2 of them, each with its own batch."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from unittest import mock

import pytest
from helpers import main_in_process, one_error_line, snapshot

pytestmark = pytest.mark.cli

SIZE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def reported_bytes(stderr: str, what: str) -> float:
    """The size a dry-run line gives `what` (e.g. 'checkpoint about'), in bytes."""
    match = re.search(rf"{what} ([0-9.]+) (B|KiB|MiB|GiB)", stderr)
    assert match, stderr[-3000:]
    return float(match.group(1)) * SIZE_UNITS[match.group(2)]


def reported_loss(stderr: str) -> float:
    match = re.search(r"dry run: one step of \S+ ran on .*: loss ([-0-9.e+]+)", stderr)
    assert match, stderr[-3000:]
    return float(match.group(1))


def first_step(tmp_path: Path, *flags: str) -> tuple[float, int]:
    """A real one-step run of `flags` on one device: (its loss, its checkpoint's bytes on disk)."""
    model_dir = tmp_path / "real"
    result = main_in_process(*flags, "--train_steps=1", "--mode=train", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    loss = json.loads((model_dir / "metrics.json").read_text())["train"]["loss"]
    checkpoint = sum(p.stat().st_size for p in (model_dir / "checkpoints").glob("ckpt-1.*"))
    return loss, checkpoint


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_sixteen_simulated_workers_step_on_the_devices_there_are_and_size_the_checkpoint(tmp_path):
    # This process has 2 CPU devices: 2 of the 16 replicas take their 4 examples each, the first 8 of
    # the global batch; a real one-device run of batches of 8 takes the same first step. (With every
    # replica simulated the loss is the whole global batch's: tests/process/test_dry_run_devices.py.)
    seed = "--seed=7"
    loss, checkpoint = first_step(tmp_path, "--model=mlp", "--global_batch_size=8", seed)
    model_dir = tmp_path / "cluster_run"
    result = main_in_process(
        *("--model=mlp", "--global_batch_size=64", seed, "--dry_run", "--strategy=multi_worker_mirrored"),
        *("--dry_run_workers=16", f"--model_dir={model_dir}"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: multi_worker_mirrored, 16 worker(s) x 1 replica = 16 (--dry_run_workers)" in result.stderr
    assert "a batch of 4 (" in result.stderr  # 64 examples over 16 replicas.
    assert "ran on 2 of the 16 replicas, 4 examples each" in result.stderr
    assert reported_loss(result.stderr) == pytest.approx(loss, rel=1e-4)
    # Weights and Adam's two slots, as the real run's checkpoint holds them (its index and counters aside).
    assert reported_bytes(result.stderr, "checkpoint about") == pytest.approx(checkpoint, rel=0.02)
    assert "dry run: ok: no problem found" in result.stderr
    assert not model_dir.exists()


def test_every_problem_is_one_line_exit_2_and_the_model_dir_is_left_as_it_was(tmp_path):
    flags = ("--model=mlp", "--global_batch_size=64", "--seed=7")
    first_step(tmp_path, *flags)
    model_dir = tmp_path / "real"
    before = snapshot(model_dir)
    with mock.patch("engine.cli.process.host_memory.memory_limit_bytes", return_value=2**20):
        result = main_in_process(
            "--model=mlp",
            "--global_batch_size=60",
            "--dry_run",
            "--strategy=multi_worker_mirrored",
            "--dry_run_workers=16",
            f"--model_dir={model_dir}",
        )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("engine.main: error: ")]
    assert len(errors) == 2, result.stderr[-3000:]
    prefix = "engine.main: error: dry run: "
    assert (
        errors[0] == f"{prefix}--global_batch_size=60 does not divide over 16 replica(s); use a multiple of 16"
    )
    assert re.fullmatch(
        re.escape(prefix) + r"a worker's 1 replica\(s\) need [0-9.]+ MiB before activations, more than the "
        r"1 MiB a host like this one may use; use a smaller model or batch, or more workers",
        errors[1],
    )
    assert "one step of" not in result.stderr  # A config with problems is not stepped.
    assert f"dry run: 2 problem(s); {model_dir} was not written" in result.stderr
    assert snapshot(model_dir) == before


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_a_parameter_server_config_names_its_busiest_ps_task_and_steps_a_workers_global_batch(tmp_path):
    flags = ("--model=wide_deep", "--dataset=clicks", "--global_batch_size=32", "--seed=3")
    loss, checkpoint = first_step(tmp_path, *flags)
    common = ("--dry_run", "--strategy=parameter_server", "--dry_run_workers=3", "--dry_run_ps=2")
    result = main_in_process(*flags, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameter_server, 3 worker(s) x 1 replica each, 2 ps task(s)" in result.stderr
    assert "ran on 1 replica(s), 32 examples each" in result.stderr  # A worker's step: a whole global batch.
    # Two tables of --ps_shards=4 shards: each shard's gather and update, in the worker's estimate.
    shards = "dry run: 8 table shard variable(s) (engine.ShardedEmbedding, --ps_shards): about 8 MiB of the step"
    assert shards in result.stderr
    assert reported_loss(result.stderr) == pytest.approx(loss, rel=1e-4)
    total = reported_bytes(result.stderr, "checkpoint about")
    assert total == pytest.approx(checkpoint, rel=0.02)
    busiest = reported_bytes(result.stderr, r"the busiest ps task, ps:\d, holds")
    assert total / 2 <= busiest < total  # Two tasks share the state, one holds at least half.
    limit = int(busiest * 0.9)
    with mock.patch("engine.cli.process.host_memory.memory_limit_bytes", return_value=limit):
        refused = main_in_process(*flags, *common)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert re.search(
        r"error: dry run: ps:\d would hold [0-9.]+ MiB of variables and optimizer slots", refused.stderr
    )
    assert "add ps tasks (--dry_run_ps) or split the largest tables (engine.ShardedEmbedding)" in refused.stderr


ASSUMES_THE_GLOBAL_BATCH = """
import keras
import tensorflow as tf


class FixedBatch(keras.layers.Layer):
    # Written on one host with --global_batch_size=64: a weight per example of the whole batch.
    def call(self, inputs):
        return inputs * tf.ones((64, 1))


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), FixedBatch(),
                             keras.layers.Dense(num_classes)])
"""


def test_a_model_that_assumes_the_global_batch_fails_the_dry_run_of_a_cluster_not_of_one_host(tmp_path):
    (tmp_path / "fixed.py").write_text(textwrap.dedent(ASSUMES_THE_GLOBAL_BATCH))
    flags = ("--model=fixed:build", "--global_batch_size=64", "--dry_run")
    alone = main_in_process(*flags, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    cluster = main_in_process(*flags, "--strategy=multi_worker_mirrored", "--dry_run_workers=8", cwd=tmp_path)
    line = one_error_line(cluster)
    # The user's line that failed, and why: 64 examples over 8 replicas are 8 each.
    assert line.startswith("engine.main: error: dry run: the step failed at fixed.py:9 (call): "), line
    assert "Dimensions must be equal, but are 8 and 64" in line and "[8,784], [64,1]" in line, line


def test_a_gpu_config_is_checked_on_cpu_devices_and_says_what_it_could_not_check():
    result = main_in_process(
        *("--model=mlp", "--dry_run", "--strategy=multi_worker_mirrored", "--dry_run_workers=2", "--num_gpus=8"),
        "--global_batch_size=128",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 worker(s) x 8 replicas = 16" in result.stderr and "a batch of 8 (" in result.stderr
    assert "8 GPU(s) per worker simulated on CPU devices: their memory is not checked" in result.stderr


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--dry_run_workers=4"],
            "--dry_run_workers=4 is for --dry_run; to start a cluster on this machine use "
            "python -m engine.launch --num_workers=4 -- ...",
        ),
        (
            ["--dry_run", "--dry_run_workers=4"],
            "--dry_run_workers=4 simulates a cluster's workers but "
            "--strategy=default runs on one host; use --strategy=multi_worker_mirrored or parameter_server",
        ),
        (
            ["--dry_run", "--strategy=parameter_server"],
            "--dry_run --strategy=parameter_server simulates a "
            "cluster: pass --dry_run_workers=N (and --dry_run_ps=M)",
        ),
        (
            ["--dry_run", "--strategy=multi_worker_mirrored", "--dry_run_workers=2", "--dry_run_ps=1"],
            "--dry_run_ps=1 simulates a parameter-server cluster's ps tasks",
        ),
        (
            ["--dry_run", "--strategy=multi_worker_mirrored", "--dry_run_workers=-2"],
            "--dry_run_workers=-2 must not be negative",
        ),
        (["--dry_run", "--mode=predict"], "--dry_run checks a training config; drop --mode=predict"),
    ],
)
def test_dry_run_flags_that_cannot_apply_are_refused_in_one_line(flags, error):
    assert error in one_error_line(main_in_process(*flags))


def test_a_dry_run_beside_a_clusters_tf_config_is_refused_when_it_also_simulates_one():
    tf_config = json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}
    )
    result = main_in_process(
        "--dry_run", "--strategy=multi_worker_mirrored", "--dry_run_workers=4", env={"TF_CONFIG": tf_config}
    )
    assert "--dry_run_workers=4 simulates a cluster but one is given" in one_error_line(result)
    # Without --dry_run_workers the cluster's own shape is checked, as its tasks would run it; no port opened.
    result = main_in_process(
        "--dry_run", "--strategy=multi_worker_mirrored", "--model=mlp", env={"TF_CONFIG": tf_config}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 worker(s) x 1 replica = 2 (the cluster's tasks)" in result.stderr


def test_only_the_users_code_has_its_errors_reported_as_problems_the_engines_own_stay_tracebacks():
    from engine.cli.run.dry_run import _Problems
    from engine.errors import UserError

    def user_step():
        raise ValueError("Dimensions must be equal, but are 8 and 64")

    def engine_check():
        raise TypeError("unsupported operand type(s)")  # a bug of the engine's: must not pass for the user's

    def refused():
        raise UserError("--global_batch_size=7 is larger than the 5 training examples")

    problems = _Problems()
    assert problems.check(user_step, runs_user_code="the step") is None
    assert problems.check(refused) is None
    assert problems.lines[0].startswith("the step failed") and "8 and 64" in problems.lines[0]
    assert problems.lines[1] == "--global_batch_size=7 is larger than the 5 training examples"
    with pytest.raises(TypeError):
        problems.check(engine_check)


def test_a_dry_run_checks_the_pipeline_of_a_data_service_run_here_without_reaching_the_service():
    # Port 1 refuses: a dry run that sent its pipeline there would wait on it forever.
    result = main_in_process(
        "--dry_run", "--model=mlp", "--dataset=synthetic", "--data_service=grpc://localhost:1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: ok: no problem found" in result.stderr
