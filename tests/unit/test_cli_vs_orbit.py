"""The CLI-against-Orbit benchmark: its summary and table, its message when Orbit is
missing, and (only where Orbit is installed; CI does not install it) a tiny run
of both sides. No timing is asserted: these machines are shared and noisy."""

import json
import subprocess
import sys

import pytest
from helpers import REPO, python_env

from benchmarks import cli_vs_orbit


def _record(run, side, rate, wall=None, fast=None):
    return {
        "run": run,
        "side": side,
        "examples_per_second": rate,
        "wall_examples_per_second": wall,
        "p90_loop_examples_per_second": fast,
    }


def test_summary_takes_the_best_run_of_each_side_and_their_ratio():
    records = [
        _record(1, "engine", 4000.0, 3900.0, 9000.0),
        _record(1, "orbit", 5000.0, 4000.0, 8000.0),
        _record(2, "orbit", 4500.0, 4200.0, 8500.0),
        _record(2, "engine", 4800.0, 4700.0, 8800.0),
    ]
    summary = cli_vs_orbit.summarize(records)
    assert summary["engine"] == {
        "best": 4800.0,
        "median": 4400.0,
        "best_wall": 4700.0,
        "best_p90_loop": 9000.0,
        "runs": 2,
    }
    assert summary["orbit"] == {
        "best": 5000.0,
        "median": 4750.0,
        "best_wall": 4200.0,
        "best_p90_loop": 8500.0,
        "runs": 2,
    }
    assert summary["engine_over_orbit"] == pytest.approx(4800.0 / 5000.0)
    assert summary["engine_over_orbit_p90_loop"] == pytest.approx(9000.0 / 8500.0)

    table = cli_vs_orbit.format_table(records, summary).splitlines()
    assert table[0].split() == [
        "run",
        "side",
        "examples/s",
        "wall",
        "ex/s",
        "p90",
        "loop",
        "ex/s",
        "global_step",
    ]
    assert [line.split()[:3] for line in table[1:5]] == [
        ["1", "engine", "4,000"],
        ["1", "orbit", "5,000"],
        ["2", "orbit", "4,500"],
        ["2", "engine", "4,800"],
    ]
    assert table[5].split() == ["best", "engine", "4,800", "4,700", "9,000", "of", "2"]
    assert table[6].split() == ["best", "orbit", "5,000", "4,200", "8,500", "of", "2"]
    assert table[7:] == ["engine/orbit (best of runs): 0.960", "engine/orbit (best of runs, p90 loop): 1.059"]


def test_a_side_without_a_rate_gives_no_ratio():
    summary = cli_vs_orbit.summarize([_record(1, "engine", 4000.0), _record(1, "orbit", None)])
    assert summary["orbit"]["best"] is None and summary["engine_over_orbit"] is None
    assert cli_vs_orbit.format_table([], summary).splitlines()[-2] == "engine/orbit (best of runs): -"


def test_runs_alternate_which_side_goes_first():
    assert [cli_vs_orbit.order(run) for run in range(3)] == [
        ("engine", "orbit"),
        ("orbit", "engine"),
        ("engine", "orbit"),
    ]


def test_the_cli_loop_and_wall_rates_come_from_its_progress_lines():
    log = "\n".join(
        [
            "I1130 23:59:59.500000 1405 job.py:326] strategy=default replicas=1",
            "I1130 23:59:59.750000 1405 progress.py:75] step 50/150  loss=2.3  759.5 examples/s",
            "W1130 23:59:59.900000 1405 other.py:1] step 60/150  1 examples/s is not a progress line",
            "I1201 00:00:00.250000 1405 progress.py:75] step 100/150  loss=2.2  8,416 examples/s  eta=0:00:01",
            "I1201 00:00:00.750000 1405 progress.py:75] step 150/150  10,460 examples/s  eta=0:00:00",
        ]
    )
    progress = cli_vs_orbit.progress_lines(log)
    assert [(step, rate) for step, _, rate in progress] == [(50, 759.5), (100, 8416.0), (150, 10460.0)]
    assert progress[2][1] - progress[0][1] == pytest.approx(1.0)  # across midnight
    assert cli_vs_orbit.wall_rate(progress, global_batch_size=64) == pytest.approx(100 * 64 / 1.0)
    assert cli_vs_orbit.wall_rate(progress[:1], global_batch_size=64) is None


def test_p90_of_the_loop_rates():
    assert cli_vs_orbit.p90([float(rate) for rate in range(1, 12)]) == pytest.approx(10.0)
    assert cli_vs_orbit.p90([5.0]) == 5.0
    assert cli_vs_orbit.p90([]) is None


def _without_orbit(module: str) -> subprocess.CompletedProcess:
    """Runs `python -m module --runs=1` as if Orbit were not installed."""
    code = (
        "import runpy, sys; sys.modules['orbit'] = None; "
        f"sys.argv = ['{module}', '--runs=1']; runpy.run_module('{module}', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
@pytest.mark.slow  # a Python process each, importing TensorFlow
@pytest.mark.parametrize("module", ["benchmarks.cli_vs_orbit", "benchmarks.orbit_peer"])
def test_without_orbit_it_says_how_to_install_it_in_one_line(module):
    result = _without_orbit(module)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "Orbit" in line]
    assert line.startswith(cli_vs_orbit.ORBIT_MISSING)
    assert "pip install --no-deps tf-models-official==2.20.0" in line


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_tiny_run_of_both_sides_writes_the_table_and_json(tmp_path):
    pytest.importorskip("orbit")
    out = tmp_path / "out.json"
    flags = ["--runs=1", "--train_steps=30", "--steps_per_loop=10", "--global_batch_size=16", f"--json={out}"]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.cli_vs_orbit", *flags],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads(out.read_text())
    assert written["settings"]["train_steps"] == 30 and written["settings"]["strategy"] == "default"
    runs = written["runs"]
    assert [(r["run"], r["side"]) for r in runs] == [(1, "engine"), (1, "orbit")]
    for record in runs:
        assert record["global_step"] == 30  # Both sides did all the work asked for.
        for key in ("examples_per_second", "wall_examples_per_second", "p90_loop_examples_per_second"):
            assert record[key] > 0, (key, record)
        assert 0 < record["loss"] < 10
    summary = written["summary"]
    assert summary["engine_over_orbit"] == pytest.approx(
        runs[0]["examples_per_second"] / runs[1]["examples_per_second"]
    )
    assert f"engine/orbit (best of runs): {summary['engine_over_orbit']:.3f}" in result.stdout
    assert f"engine/orbit (best of runs, p90 loop): {summary['engine_over_orbit_p90_loop']:.3f}" in result.stdout
