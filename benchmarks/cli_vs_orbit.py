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
per-loop progress lines. `p90 loop ex/s` is the 90th percentile of the single
loops' rates: on a machine shared with other work, loops that ran while the
other tenants were idle, i.e. close to what a quiet machine gives.

The table shows every run and the best run of each side; the ratios are
engine/orbit of the best `examples/s` (the acceptance figure) and of the
best `p90 loop ex/s`. `--engine_flags` passes more flags to the CLI
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
        "--log_prefix",  # absl's timestamps on the progress lines: progress_lines reads them.
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
    progress = progress_lines(completed.stderr)
    return {
        "examples_per_second": metrics["examples_per_second"],
        "wall_examples_per_second": wall_rate(progress, settings["global_batch_size"]),
        "p90_loop_examples_per_second": p90([rate for _, _, rate in progress[1:]]),
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
        "examples_per_second": result["examples_per_second"],
        "wall_examples_per_second": result["wall_examples_per_second"],
        "p90_loop_examples_per_second": p90(result["loop_examples_per_second"]),
        "global_step": result["global_step"],
        "loss": result["loss"],
    }


# The CLI's per-loop progress line with absl's prefix (--log_prefix), whole (into a pipe):
# "I1130 14:37:09.009669 140589 progress.py:75] step 950/1000  loss=0.01281 ...  4,521 examples/s  eta=..."
_PROGRESS_LINE = re.compile(
    r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] step (\d+)/\d+  .*?\b([\d,]+(?:\.\d+)?) examples/s\b"
)


def progress_lines(log: str) -> list[tuple[int, float, float]]:
    """(step, seconds of the day, that loop's examples/s) of every progress line
    the CLI logged (one a compiled loop)."""
    lines: list[tuple[int, float, float]] = []
    for line in log.splitlines():
        match = _PROGRESS_LINE.match(line)
        if match:
            hours, minutes, seconds, step, rate = match.groups()
            moment = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
            if lines and moment < lines[-1][1]:  # Past midnight.
                moment += 86400
            lines.append((int(step), moment, float(rate.replace(",", ""))))
    return lines


def wall_rate(progress: Sequence[tuple[int, float, float]], global_batch_size: int) -> float | None:
    """Examples/s from the end of the first loop to the end of the last: everything the
    process does between loops included (Orbit's StepTimer view); None below two loops."""
    if len(progress) < 2 or progress[-1][1] <= progress[0][1]:
        return None
    (first_step, first_time, _), (last_step, last_time, _) = progress[0], progress[-1]
    return (last_step - first_step) * global_batch_size / (last_time - first_time)


def p90(loop_rates: Sequence[float]) -> float | None:
    """The 90th percentile of the per-loop rates (first loop left out by the caller): what
    the loop reaches when the machine's other tenants leave it alone; None without loops."""
    if len(loop_rates) < 2:
        return loop_rates[0] if loop_rates else None
    return statistics.quantiles(loop_rates, n=10, method="inclusive")[-1]


RUNNERS = {"engine": run_engine, "orbit": run_orbit}


def order(run: int) -> tuple[str, str]:
    """engine, orbit | orbit, engine | engine, orbit | ...: alternating which side goes first."""
    return SIDES if run % 2 == 0 else SIDES[::-1]


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each side's best run of every rate (and median examples/s); engine/orbit of the best
    examples/s (the acceptance figure) and of the best p90 loop rates."""

    def rates(side: str, key: str) -> list[float]:
        return [r[key] for r in records if r["side"] == side and r.get(key)]

    summary: dict[str, Any] = {}
    for side in SIDES:
        speeds = rates(side, "examples_per_second")
        walls, fast = rates(side, "wall_examples_per_second"), rates(side, "p90_loop_examples_per_second")
        summary[side] = {
            "best": max(speeds) if speeds else None,
            "median": statistics.median(speeds) if speeds else None,
            "best_wall": max(walls) if walls else None,
            "best_p90_loop": max(fast) if fast else None,
            "runs": len(speeds),
        }

    def ratio(key: str) -> float | None:
        engine, orbit_ = summary["engine"][key], summary["orbit"][key]
        return engine / orbit_ if engine and orbit_ else None

    summary["engine_over_orbit"] = ratio("best")
    summary["engine_over_orbit_p90_loop"] = ratio("best_p90_loop")
    return summary


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_table(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    rows = [("run", "side", "examples/s", "wall ex/s", "p90 loop ex/s", "global_step")]
    for record in records:
        rows.append(
            (
                str(record["run"]),
                record["side"],
                _rate(record["examples_per_second"]),
                _rate(record.get("wall_examples_per_second")),
                _rate(record.get("p90_loop_examples_per_second")),
                str(record.get("global_step", "")),
            )
        )
    for side in SIDES:
        best = summary[side]
        rows.append(
            (
                "best",
                side,
                _rate(best["best"]),
                _rate(best["best_wall"]),
                _rate(best["best_p90_loop"]),
                f"of {best['runs']}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    for label, key in (("", "engine_over_orbit"), (", p90 loop", "engine_over_orbit_p90_loop")):
        ratio = summary[key]
        lines.append(f"engine/orbit (best of runs{label}): {'-' if ratio is None else f'{ratio:.3f}'}")
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
