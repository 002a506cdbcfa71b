"""Smoke tests of the throughput benchmark and the sweep, in tiny configurations.

They run the scripts as users do (a subprocess each: logical CPU devices must
be set before TensorFlow starts) and check what they write. No timing is
asserted: these machines are shared and noisy.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow  # every test here starts processes


def _run(args, timeout):
    """Runs the script in its own process group, so that a timeout also ends
    the children it started (the sweep runs one per device count)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        if process.poll() is None:
            process.communicate(timeout=30)
    completed = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


@pytest.mark.timeout(400)
def test_throughput_writes_json_with_a_row_per_runner(tmp_path):
    out = tmp_path / "out.json"
    completed = _run(
        [
            "benchmarks.throughput",
            "--model=cnn",
            "--strategy=default",
            "--runners=engine,fit,raw",
            "--global_batch_size=16",
            "--steps_per_loop=2",
            "--warmup_steps=2",
            "--steps=4",
            "--repeats=1",
            "--peak_matmul_size=128",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())

    assert set(payload) >= {"results", "ratios", "peak_tflops", "machine"}
    assert isinstance(payload["peak_tflops"], float) and payload["peak_tflops"] > 0
    assert isinstance(payload["machine"], dict) and payload["machine"]
    assert set(payload["ratios"]) >= {"engine/fit", "engine/raw"}
    for value in (payload["ratios"]["engine/fit"], payload["ratios"]["engine/raw"]):
        assert value is None or (isinstance(value, float) and value > 0)

    rows = payload["results"]
    assert [row["runner"] for row in rows] == ["engine", "fit", "raw"]
    types = {
        "runner": str,
        "model": str,
        "strategy": str,
        "examples_per_second": float,
        "min": float,
        "max": float,
        "global_batch_size": int,
        "replicas": int,
        "mixed_precision": str,
        "jit_compile": bool,
        "flops_per_example": int,
        "achieved_tflops": float,
    }
    for row in rows:
        for key, kind in types.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert row["error"] is None, row  # a crashed runner fails the test
        assert row["examples_per_second"] > 0, row
        assert row["model"] == "cnn" and row["strategy"] == "default"
        assert row["global_batch_size"] == 16 and row["replicas"] == 1
        assert row["flops_per_example"] > 0
    # The plain table goes to stdout.
    assert "engine" in completed.stdout and "ratios:" in completed.stdout


@pytest.mark.timeout(400)
def test_sweep_writes_png_and_markdown(tmp_path):
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "sweep"
    _run(
        [
            "benchmarks.sweep",
            f"--out_dir={out_dir}",
            "--model=cnn",
            "--steps_per_loop_values=1,2",
            "--replica_values=1,2",
            "--sweep_steps_per_loop=2",
            "--global_batch_size=16",
            "--steps=4",
            "--warmup_steps=2",
            "--repeats=1",
        ],
        timeout=360,
    )
    png = out_dir / "sweep.png"
    markdown = (out_dir / "sweep.md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| steps_per_loop |" in markdown and "| replicas |" in markdown
    assert markdown.count("| engine |") == 4 and markdown.count("| raw |") == 4
    records = json.loads((out_dir / "sweep.json").read_text())["records"]
    assert {(r["sweep"], r["x"]) for r in records} == {
        ("steps_per_loop", 1),
        ("steps_per_loop", 2),
        ("replicas", 1),
        ("replicas", 2),
    }
    assert [r for r in records if r["error"] is not None or not r["examples_per_second"] > 0] == []
    assert {r["replicas"] for r in records if r["sweep"] == "replicas"} == {1, 2}
