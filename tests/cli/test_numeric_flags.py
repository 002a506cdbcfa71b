"""Every numeric flag refuses what the engine cannot count, with one line naming it:
NaN and infinities, integers beyond int32 (loop lengths, cadences, batch sizes) or
int64 (steps), timeouts beyond int64 milliseconds; and a task of a cluster without one.
In-process: absl parses the flags and `RunConfig` validates them, as engine.main does.

Covers: engine/cli/config/settings.py.
"""

import dataclasses

import pytest
from helpers import main_in_process, one_error_line, run_config, snapshot

from engine.cli.config.settings import CLUSTER_SETTINGS, RunConfig
from engine.errors import UserError

NUMERIC = [f.name for f in dataclasses.fields(RunConfig) if str(f.type).split(" |")[0] in ("int", "float")]
FLOATS = [f.name for f in dataclasses.fields(RunConfig) if str(f.type).startswith("float")]
# The first integer each flag refuses: int32 unless the engine counts it in another type.
FIRST_REFUSED = {"train_steps": 2**63, "seed": 2**32, "cpu_devices": 1025}
INTS = [name for name in NUMERIC if name not in FLOATS]
# The engine's loops, cadences and sizes: their int32 maximum itself is accepted.
INT32_ACCEPTED = ["steps_per_loop", "log_every", "eval_every", "checkpoint_every", "histogram_every"]

CASES = [
    *[
        ([f"--{name}={value}"], f"--{name}={value} must be a finite number")
        for name in FLOATS
        for value in ("nan", "inf", "-inf")
    ],
    *[
        (
            [f"--{name}={FIRST_REFUSED.get(name, 2**31)}"],
            f"--{name}={FIRST_REFUSED.get(name, 2**31)} is more than the engine can count; use at most",
        )
        for name in INTS
    ],
    (["--steps_per_loop=3000000000"], "--steps_per_loop=3000000000 is more than the engine can count"),
    (["--startup_timeout=inf"], "--startup_timeout=inf must be a finite number (0 waits forever)"),
    (["--startup_timeout=1e300"], "--startup_timeout=1e+300 is beyond the longest timeout, 1e+09 seconds"),
    (["--collective_timeout=1e10"], "--collective_timeout=1e+10 is beyond the longest timeout"),
    (["--mode=continuous_eval", "--eval_timeout=nan"], "--eval_timeout=nan must be a finite number"),
    (
        ["--train_steps=9223372036854775807"],
        "--train_steps=9223372036854775807 trains beyond what the engine can "
        "count: at --global_batch_size=64, a run counts at most 144115188075855871 steps",
    ),
    (["--slurm_port_base=0"], "--slurm_port_base=0 must be a port, 1-65535"),
    (["--slurm_port_base=65536"], "--slurm_port_base=65536 must be a port"),
    (["--task_type=worker"], "--task_type=worker / --task_index=None given without a cluster"),
    (["--task_index=1"], "--task_type=None / --task_index=1 given without a cluster"),
]


def test_the_table_covers_every_numeric_flag():
    covered = {case[0][0].split("=")[0][2:] for case in CASES}
    assert set(NUMERIC) <= covered and {"train_steps", "eval_timeout", "startup_timeout"} <= set(NUMERIC)


@pytest.mark.cli
@pytest.mark.parametrize("flags,message", CASES, ids=[" ".join(flags) for flags, _ in CASES])
def test_a_numeric_flag_the_engine_cannot_count_is_one_line(flags, message):
    with pytest.raises(UserError) as refused:
        run_config(*flags, env={"TF_CONFIG": ""})
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.cli
@pytest.mark.parametrize("name", INT32_ACCEPTED)
def test_the_largest_count_is_accepted(name):
    assert getattr(run_config(f"--{name}={2**31 - 1}"), name) == 2**31 - 1
    assert run_config("--global_batch_size=1", f"--train_steps={2**63 - 1}").train_steps == 2**63 - 1


def test_cluster_settings_are_numeric_flags_of_the_table_too():
    assert {"task_index", "slurm_port_base"} <= set(CLUSTER_SETTINGS) & set(NUMERIC)


# Refused by the job, which knows the data's size, before it writes anything.
JOB_CASES = [
    (["--epochs=1e300"], "--epochs=1e+300 trains beyond what the engine can count: at --global_batch_size=64"),
    (["--epochs=1e300", "--lr_schedule=cosine"], "--epochs=1e+300 trains beyond what the engine can count"),
]


@pytest.mark.cli
@pytest.mark.parametrize("flags,message", JOB_CASES, ids=[" ".join(flags) for flags, _ in JOB_CASES])
def test_a_run_too_long_to_count_is_refused_before_any_write(tmp_path, flags, message):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    line = one_error_line(main_in_process(*flags, "--model=mlp", f"--model_dir={model_dir}"))
    assert message in line, line
    assert snapshot(model_dir) == before


@pytest.mark.cli
def test_a_batch_that_cannot_fit_in_memory_is_refused_before_any_allocation(tmp_path):
    """TFRecord files do not say how many examples they hold, so only the memory bounds the batch."""
    import numpy as np

    from input import write_tfrecords

    write_tfrecords(str(tmp_path / "data" / "train-0"), np.zeros((4, 28, 28, 1), np.uint8), np.arange(4))
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    before = snapshot(model_dir)
    result = main_in_process(
        "--dataset=tfrecord",
        f"--data_dir={tmp_path / 'data'}",
        "--global_batch_size=1000000000",
        "--train_steps=3",
        "--model=mlp",
        f"--model_dir={model_dir}",
    )
    line = one_error_line(result)
    assert "--global_batch_size=1000000000 needs 2924.4 GiB per batch of (28, 28, 1) float32 examples" in line, (
        line
    )
    assert "this process may use; use at most" in line
    assert snapshot(model_dir) == before
