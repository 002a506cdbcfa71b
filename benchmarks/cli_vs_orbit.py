r"""The engine CLI's own `examples_per_second` against TF Model Garden's Orbit on the same work.

    python -m benchmarks.cli_vs_orbit --runs=2 [--strategy=mirrored --cpu_devices=2] [--json=out.json]

Each run starts two processes, one after the other: `python -m engine.main`
(`--dataset=synthetic --mode=train`, a fresh temporary model_dir; its
`examples_per_second` is read from metrics.json) and
`python -m benchmarks.orbit_peer` (the same model, batch, loop length,
steps, seed, checkpoint cadence and summaries through `orbit.Controller`).
Which side goes first alternates from run to run (engine, orbit, orbit,
engine, ...), so that drift of a shared machine hits both alike.

Two rates a side, both leaving out the first compiled loop (tracing):
`examples/s` is the compiled loops alone with their results read back (the
CLI's metrics.json figure; the peer times its `trainer.train` calls the same
way); `wall ex/s` runs from the end of the first loop to the end of the last,
whatever the process does between loops (summaries, log lines, checkpoints)
included: Orbit's own StepTimer view, and for the CLI the timestamps of its
per-loop progress lines.

The table shows every run and the best run of each side; the ratio is
engine/orbit of the best `examples/s`. `--engine_flags` passes more flags to the CLI
only, e.g. `--engine_flags=--device_data_mb=0,--input_pipeline=global` to
feed it through the same tf.data path as the peer.

Orbit is not a dependency of the project; install it without its
dependencies, which would replace TensorFlow:
`pip install --no-deps tf-models-official==2.20.0 tf-keras==2.21.0`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
SIDES = ("engine", "orbit")
ORBIT_MISSING = (
    "Orbit is not installed; install it without its dependencies (they would replace TensorFlow): "
    "pip install --no-deps tf-models-official==2.20.0 tf-keras==2.21.0"
)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a script (the peer imports ORBIT_MISSING from here)."""
    flags.DEFINE_integer("runs", 2, "Runs of each side, alternating which goes first.")
    flags.DEFINE_integer("train_steps", 2000, "Global steps of every run (~20-40 s a run on 2 cores).")
    flags.DEFINE_enum("strategy", "default", ["default", "mirrored"], "The tf.distribute strategy of both.")
    flags.DEFINE_integer("cpu_devices", 1, "Logical CPU devices (replicas of --strategy=mirrored).")
    flags.DEFINE_string("model", "cnn", "Model name from the models registry.")
    flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all replicas.")
    flags.DEFINE_integer("steps_per_loop", 50, "Steps per compiled loop.")
    flags.DEFINE_integer("seed", 42, "Seed of both.")
    flags.DEFINE_list("engine_flags", [], "More flags for engine.main only, comma-separated.")
    flags.DEFINE_integer("timeout", 900, "Seconds one process may take.")
    flags.DEFINE_string("json", None, "Also write the runs and the summary as JSON to this path.")


def orbit_missing() -> str | None:
    """The one-line install hint when Orbit (or the tf_keras it imports) cannot be found."""
    for module in ("orbit", "tf_keras"):
        try:
            if importlib.util.find_spec(module) is None:
                return ORBIT_MISSING
        except (ImportError, ValueError):  # A module hidden as sys.modules[name] = None, or broken.
            return ORBIT_MISSING
    return None


def common_flags(settings: dict[str, Any]) -> list[str]:
    keys = ("strategy", "cpu_devices", "model", "global_batch_size", "steps_per_loop", "train_steps", "seed")
    return [f"--{key}={settings[key]}" for key in keys]


def engine_command(settings: dict[str, Any], model_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine.main",
        *common_flags(settings),
        "--dataset=synthetic",
        "--mode=train",
        f"--model_dir={model_dir}",
        *settings["engine_flags"],
    ]


def orbit_command(settings: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.orbit_peer", *common_flags(settings)]


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs one side to completion; RuntimeError with the tail of its stderr if it fails."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    completed = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if completed.returncode != 0:
        tail = "\n".join((completed.stderr or completed.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[1:4])} exited {completed.returncode}:\n{tail}")
    return completed


def run_engine(settings: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cli-vs-orbit-") as scratch:
        model_dir = os.path.join(scratch, "model")
        completed = _run(engine_command(settings, model_dir), settings["timeout"])
        with open(os.path.join(model_dir, "metrics.json")) as file:
            metrics = json.load(file)
    return {
        "examples_per_second": metrics["examples_per_second"],
        "wall_examples_per_second": wall_rate(progress_times(completed.stderr), settings["global_batch_size"]),
        "global_step": metrics["global_step"],
        "loss": metrics["train"].get("loss"),
    }


def run_orbit(settings: dict[str, Any]) -> dict[str, Any]:
    stdout = _run(orbit_command(settings), settings["timeout"]).stdout
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"benchmarks.orbit_peer printed no JSON line; its output ended:\n{stdout[-2000:]}")
    result = json.loads(lines[-1])
    return {
        key: result[key]
        for key in ("examples_per_second", "wall_examples_per_second", "global_step", "loss")
        if key in result
    }


# An absl log line of the CLI's progress callback: "I1130 14:37:09.009669 ... progress.py:75] step 950/1000  ..."
_PROGRESS_LINE = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] step (\d+)/\d+ ")


def progress_times(log: str) -> list[tuple[int, float]]:
    """(step, seconds of the day) of every progress line the CLI logged (one a loop)."""
    times: list[tuple[int, float]] = []
    for line in log.splitlines():
        match = _PROGRESS_LINE.match(line)
        if match:
            hours, minutes, seconds, step = match.groups()
            moment = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
            if times and moment < times[-1][1]:  # Past midnight.
                moment += 86400
            times.append((int(step), moment))
    return times


def wall_rate(times: Sequence[tuple[int, float]], global_batch_size: int) -> float | None:
    """Examples/s from the end of the first loop to the end of the last: everything the
    process does between loops included (Orbit's StepTimer view); None below two loops."""
    if len(times) < 2 or times[-1][1] <= times[0][1]:
        return None
    (first_step, first_time), (last_step, last_time) = times[0], times[-1]
    return (last_step - first_step) * global_batch_size / (last_time - first_time)


RUNNERS = {"engine": run_engine, "orbit": run_orbit}


def order(run: int) -> tuple[str, str]:
    """engine, orbit | orbit, engine | engine, orbit | ...: alternating which side goes first."""
    return SIDES if run % 2 == 0 else SIDES[::-1]


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Best and median examples/s of each side (and best wall rate), and engine/orbit of the bests."""
    summary: dict[str, Any] = {}
    for side in SIDES:
        rates = [r["examples_per_second"] for r in records if r["side"] == side and r["examples_per_second"]]
        walls = [
            r["wall_examples_per_second"]
            for r in records
            if r["side"] == side and r.get("wall_examples_per_second")
        ]
        summary[side] = {
            "best": max(rates) if rates else None,
            "median": statistics.median(rates) if rates else None,
            "best_wall": max(walls) if walls else None,
            "runs": len(rates),
        }
    best_engine, best_orbit = summary["engine"]["best"], summary["orbit"]["best"]
    summary["engine_over_orbit"] = best_engine / best_orbit if best_engine and best_orbit else None
    return summary


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_table(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    rows = [("run", "side", "examples/s", "wall ex/s", "global_step")]
    for record in records:
        rows.append(
            (
                str(record["run"]),
                record["side"],
                _rate(record["examples_per_second"]),
                _rate(record.get("wall_examples_per_second")),
                str(record.get("global_step", "")),
            )
        )
    for side in SIDES:
        best = summary[side]
        rows.append(("best", side, _rate(best["best"]), _rate(best["best_wall"]), f"of {best['runs']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    ratio = summary["engine_over_orbit"]
    lines.append(f"engine/orbit (best of runs): {'-' if ratio is None else f'{ratio:.3f}'}")
    return "\n".join(lines)


def compare(settings: dict[str, Any]) -> dict[str, Any]:
    records = []
    for run in range(settings["runs"]):
        for side in order(run):
            print(f"run {run + 1}/{settings['runs']}: {side} ...", file=sys.stderr, flush=True)
            records.append({"run": run + 1, "side": side, **RUNNERS[side](settings)})
    return {"settings": settings, "runs": records, "summary": summarize(records)}


def main(argv: list[str]) -> None:
    del argv
    problem = orbit_missing()
    if problem:
        sys.exit(problem)
    if FLAGS.runs < 1 or FLAGS.train_steps < 1:
        sys.exit(f"--runs={FLAGS.runs} and --train_steps={FLAGS.train_steps} must be at least 1")
    settings = {
        name: getattr(FLAGS, name)
        for name in (
            "runs",
            "train_steps",
            "strategy",
            "cpu_devices",
            "model",
            "global_batch_size",
            "steps_per_loop",
            "seed",
            "engine_flags",
            "timeout",
        )
    }
    try:
        result = compare(settings)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        sys.exit(f"cli_vs_orbit: {error}")
    print(format_table(result["runs"], result["summary"]))
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
