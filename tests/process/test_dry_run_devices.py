"""`engine.main --dry_run` in a process of its own, where it splits the CPU into as many
devices as the simulated cluster has replicas: the step of 16 workers is the real first step
of the whole global batch. (Its checks and refusals, in-process: tests/cli/test_dry_run.py.)"""

import json
import re

import pytest
from helpers import main_in_process, run_main


def test_sixteen_workers_simulated_on_sixteen_devices_take_one_hosts_first_step(tmp_path):
    flags = ("--model=mlp", "--global_batch_size=64", "--seed=7")
    result = run_main(
        *flags, "--dry_run", "--strategy=multi_worker_mirrored", "--dry_run_workers=16", timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one step of mlp ran on 16 replica(s), 4 examples each" in result.stderr
    model_dir = tmp_path / "one_host"  # The same first step on one device of this process.
    real = main_in_process(*flags, "--train_steps=1", "--mode=train", f"--model_dir={model_dir}")
    assert real.returncode == 0, real.stderr[-3000:]
    loss = json.loads((model_dir / "metrics.json").read_text())["train"]["loss"]
    simulated = float(re.search(r"4 examples each: loss ([-0-9.e+]+)", result.stderr).group(1))
    assert simulated == pytest.approx(loss, rel=1e-5)
    assert "dry run: ok: no problem found" in result.stderr
