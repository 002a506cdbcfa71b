"""The research examples of README.md and docs/research.md run exactly as printed there."""

import ast
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, readme_example, snapshot


@pytest.mark.timeout(600)
def test_readme_research_example_runs(tmp_path):
    script = "\n".join(
        readme_example(name)
        for name in (
            "research",
            "step_fn",
            "resident",
            "data_forms",
            "callbacks",
            "wrapped",
            "two_optimizers",
            "from_fit",
        )
    )
    (tmp_path / "example.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # Not even at the exit, from a __del__.
    assert "'num_examples': 200" in result.stdout
    assert "positioned at step 100" in result.stdout  # engine.PerReplicaBatches(from_step=)
    assert (tmp_path / "runs" / "research" / "checkpoints" / "checkpoint").exists()
    assert list((tmp_path / "runs" / "research" / "train").glob("events.out.tfevents.*"))
    epochs = [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert epochs == ["epoch 1", "epoch 2", "epoch 3"]
    assert (tmp_path / "runs" / "research-callbacks" / "best" / "best.json").exists()
    lines = result.stdout.splitlines()
    assert "5" in lines  # The wrapped module's variables, found through its Keras models.
    for prefix, run in (
        ("resident: ", "research-resident"),  # Arrays kept on the devices (ResidentData).
        ("wrapped: ", "research-wrapped"),
        ("two optimizers: ", "research-two-optimizers"),
        ("from fit: ", "research-from-fit"),  # A compiled Keras model with its own compute_loss, numpy arrays.
    ):
        [evaluation] = [line for line in lines if line.startswith(prefix)]
        logs = ast.literal_eval(evaluation[len(prefix) :])
        assert logs["num_examples"] == 200 and logs["accuracy"] > 0.9, evaluation
        assert (tmp_path / "runs" / run / "checkpoints" / "ckpt-200.index").exists()
    assert "['learning_rate/encoder', 'learning_rate/head']" in lines
    # A rerun restores step 300, has nothing left to train, and evaluates
    # the restored weights to the very same figures.
    checkpoints = {run.name: snapshot(run / "checkpoints") for run in (tmp_path / "runs").iterdir()}
    rerun = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    restored = re.search(r"Restored \S*runs/research/checkpoints/ckpt-300 at step 300", rerun.stderr)
    assert restored, rerun.stderr[-3000:]
    assert "nothing to train: the global step 300 is already at or past steps=300" in rerun.stderr
    # Nothing was trained again: every checkpoint directory is byte for byte as the first run left it.
    assert {run.name: snapshot(run / "checkpoints") for run in (tmp_path / "runs").iterdir()} == checkpoints
    assert rerun.stdout.splitlines()[0] == result.stdout.splitlines()[0]
    evaluations = [line for line in lines if line.startswith(("resident: ", "wrapped: ", "two optimizers: "))]
    assert [
        line
        for line in rerun.stdout.splitlines()
        if line.startswith(("resident: ", "wrapped: ", "two optimizers: "))
    ] == evaluations
