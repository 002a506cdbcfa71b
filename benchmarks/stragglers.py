r"""What the straggler report costs on an even cluster: the same multi_worker_mirrored run with
the report (the default) and without it (`--straggler_margin=0`: no timing in the step),
alternately, each in a fresh local cluster.

    python -m benchmarks.stragglers --train_steps=400 --repeats=3 --json=benchmarks/out/stragglers.json

Each run is `python -m engine.launch --num_workers=N -- --strategy=multi_worker_mirrored
--model=M --train_steps=S --steps_per_loop=L --mode=train` on a model_dir of its own; its figure
is the chief's steady examples/s from metrics.json (the loops after the first: tracing left
out). Short loops (`--steps_per_loop=10`) are the report's worst case: its figures travel with
every loop's stop agreement; `--device_data_mb=0` reads the batches through a tf.data iterator,
whose waits are timed too (the digits are otherwise kept on the devices). Reported: every run's
figure, the medians of each way, and `ratio` = with / without (1.0: free). On a shared machine
the runs' own spread is the limit of what the ratio can tell: it is printed beside it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
WAYS = ("without", "with")  # --straggler_margin=0, then the default
REPO = Path(__file__).resolve().parents[1]


def define_flags() -> None:
    flags.DEFINE_integer("num_workers", 2, "Workers of the local cluster.")
    flags.DEFINE_string("model", "cnn", "engine.main's --model.")
    flags.DEFINE_integer("train_steps", 400, "Steps of each run.")
    flags.DEFINE_integer(
        "steps_per_loop", 10, "Steps per compiled loop: a stop agreement (and the report's figures) each."
    )
    flags.DEFINE_integer("repeats", 3, "Runs of each way, alternating.")
    flags.DEFINE_integer(
        "device_data_mb",
        None,
        "engine.main's --device_data_mb; 0: batches through a tf.data iterator (its waits timed).",
    )
    flags.DEFINE_integer("timeout", 600, "Seconds a run may take.")
    flags.DEFINE_string("json", None, "Also write the results here.")


def run_once(way: str, model_dir: Path) -> float:
    """One cluster's run; its chief's steady examples/s."""
    command = [
        sys.executable,
        "-m",
        "engine.launch",
        f"--num_workers={FLAGS.num_workers}",
        "--",
        "--strategy=multi_worker_mirrored",
        f"--model={FLAGS.model}",
        f"--train_steps={FLAGS.train_steps}",
        f"--steps_per_loop={FLAGS.steps_per_loop}",
        "--mode=train",
        f"--model_dir={model_dir}",
        *(["--straggler_margin=0"] if way == "without" else []),
        *([f"--device_data_mb={FLAGS.device_data_mb}"] if FLAGS.device_data_mb is not None else []),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=FLAGS.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{way}: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    record = json.loads((model_dir / "metrics.json").read_text())
    return float(record["examples_per_second"])


def measure() -> dict:
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="stragglers-bench-") as scratch:
        for repeat in range(FLAGS.repeats):
            for way in WAYS:
                runs[way].append(run_once(way, Path(scratch) / f"{way}-{repeat}"))
                print(f"{way:8s} run {repeat + 1}: {runs[way][-1]:.1f} examples/s", flush=True)
    medians = {way: statistics.median(figures) for way, figures in runs.items()}
    spread = {way: (max(figures) - min(figures)) / medians[way] for way, figures in runs.items()}
    return {
        "num_workers": FLAGS.num_workers,
        "model": FLAGS.model,
        "train_steps": FLAGS.train_steps,
        "steps_per_loop": FLAGS.steps_per_loop,
        "device_data_mb": FLAGS.device_data_mb,
        "runs": runs,
        "median_examples_per_second": medians,
        "spread": spread,  # (max - min) / median of each way's runs
        "ratio": medians["with"] / medians["without"],
    }


def main(argv: list[str]) -> None:
    del argv
    result = measure()
    medians, spread = result["median_examples_per_second"], result["spread"]
    print(
        f"ratio (with / without the report) {result['ratio']:.3f}; medians {medians['with']:.1f} / "
        f"{medians['without']:.1f} examples/s; spread of the runs {spread['with']:.1%} / {spread['without']:.1%}"
    )
    if FLAGS.json:
        Path(FLAGS.json).parent.mkdir(parents=True, exist_ok=True)
        Path(FLAGS.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
