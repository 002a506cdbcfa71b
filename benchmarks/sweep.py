r"""Sweeps of the engine's throughput (with the raw loop as the reference).

    python -m benchmarks.sweep            # writes under benchmarks/out/sweep (git-ignored)

- steps_per_loop in `--steps_per_loop_values` (default 1, 10, 100), default
  strategy, one replica;
- replicas in `--replica_values` (default 1, 2 logical CPUs), mirrored
  strategy, `--sweep_steps_per_loop` steps per loop.

Writes `sweep.md` (tables), `sweep.json` (every run's payload) and, when
matplotlib is installed, `sweep.png`. Logical CPU devices can only be set
before TensorFlow starts, so each replica count runs in its own child process
(`benchmarks.throughput.run_benchmark`, in-process there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

from absl import app, flags

from engine.lean_imports import import_tensorflow_lean

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "out_dir",
    "benchmarks/out/sweep",
    "Where sweep.md, sweep.json and sweep.png go (default: git-ignored, beside the "
    "committed benchmarks/results).",
)
flags.DEFINE_string("model", "cnn", "Model to sweep.")
flags.DEFINE_list("runners", ["engine", "raw"], "Runners in every configuration.")
flags.DEFINE_list("steps_per_loop_values", ["1", "10", "100"], "steps_per_loop values to sweep.")
flags.DEFINE_list("replica_values", ["1", "2"], "Logical CPU replica counts to sweep (mirrored).")
flags.DEFINE_integer("sweep_steps_per_loop", 50, "steps_per_loop of the replica sweep.")
flags.DEFINE_integer("global_batch_size", 64, "Global batch size.")
flags.DEFINE_integer("steps", 200, "Steps per timed window (rounded up to a multiple of steps_per_loop).")
flags.DEFINE_integer("warmup_steps", 100, "Warm-up steps (at least one loop).")
flags.DEFINE_integer("repeats", 3, "Timed windows per runner.")
flags.DEFINE_integer("timeout", 1800, "Seconds allowed for each child process.")
flags.DEFINE_string("worker", None, "Internal: run the JSON list of configs in this file, in-process.")


def _configs(base) -> list[tuple[str, object]]:
    """(sweep name, BenchConfig) pairs, in run order."""
    configs = []
    for value in FLAGS.steps_per_loop_values:
        spl = int(value)
        configs.append(
            (
                "steps_per_loop",
                replace(
                    base,
                    strategy="default",
                    cpu_devices=1,
                    steps_per_loop=spl,
                    steps=_round_up(base.steps, spl),
                    warmup_steps=_round_up(max(base.warmup_steps, spl), spl),
                ),
            )
        )
    for value in FLAGS.replica_values:
        spl = FLAGS.sweep_steps_per_loop
        configs.append(
            (
                "replicas",
                replace(
                    base,
                    strategy="mirrored",
                    cpu_devices=int(value),
                    steps_per_loop=spl,
                    steps=_round_up(base.steps, spl),
                    warmup_steps=_round_up(max(base.warmup_steps, spl), spl),
                ),
            )
        )
    return configs


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def run_worker(path: str) -> None:
    """Child process: every config here shares one cpu_devices value."""
    from benchmarks.throughput import BenchConfig, run_benchmark
    from engine import configure_cpu_devices

    with open(path) as handle:
        job = json.load(handle)
    configs = [BenchConfig(**{**c, "runners": tuple(c["runners"])}) for c in job["configs"]]
    if configs[0].cpu_devices > 1:
        configure_cpu_devices(configs[0].cpu_devices)
    payloads = [run_benchmark(config) for config in configs]
    with open(job["output"], "w") as handle:
        json.dump(payloads, handle)


def _run_children(configs, out_dir) -> list[dict]:
    """Groups configs by cpu_devices, one child process per group."""
    by_devices: dict[int, list[int]] = {}
    for index, (_, config) in enumerate(configs):
        by_devices.setdefault(config.cpu_devices, []).append(index)
    payloads: list[dict | None] = [None] * len(configs)
    for devices, indices in by_devices.items():
        job_path = os.path.join(out_dir, f"job_cpu{devices}.json")
        output = os.path.join(out_dir, f"job_cpu{devices}.out.json")
        with open(job_path, "w") as handle:
            json.dump({"configs": [_as_json(configs[i][1]) for i in indices], "output": output}, handle)
        began = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "benchmarks.sweep", f"--worker={job_path}"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            timeout=FLAGS.timeout,
            capture_output=True,
            text=True,
        )
        print(
            f"[sweep] cpu_devices={devices}: {len(indices)} config(s) in {time.perf_counter() - began:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"sweep child (cpu_devices={devices}) failed:\n{completed.stderr[-3000:]}")
        with open(output) as handle:
            for index, payload in zip(indices, json.load(handle), strict=False):
                payloads[index] = payload
        os.remove(job_path)
        os.remove(output)
    return payloads


def _as_json(config) -> dict:
    data = asdict(config)
    data["runners"] = list(data["runners"])
    return data


def _rows(configs, payloads):
    """Flat records: sweep, x value, runner, median/min/max, error."""
    records = []
    for (sweep, config), payload in zip(configs, payloads, strict=False):
        x = config.steps_per_loop if sweep == "steps_per_loop" else config.cpu_devices
        for row in payload["results"]:
            records.append(
                {
                    "sweep": sweep,
                    "x": x,
                    "runner": row["runner"],
                    "examples_per_second": row["examples_per_second"],
                    "min": row["min"],
                    "max": row["max"],
                    "replicas": row["replicas"],
                    "steps_per_loop": config.steps_per_loop,
                    "strategy": config.strategy,
                    "error": row["error"],
                }
            )
    return records


def write_markdown(records, path: str, command: str) -> None:
    lines = [
        f"# Engine throughput sweeps ({FLAGS.model}, global batch {FLAGS.global_batch_size})",
        "",
        f"Command: `{command}`",
        "",
    ]
    for sweep, label in (
        ("steps_per_loop", "steps_per_loop (default strategy, 1 replica)"),
        ("replicas", f"replicas (mirrored, logical CPUs, steps_per_loop={FLAGS.sweep_steps_per_loop})"),
    ):
        lines += [
            f"## {label}",
            "",
            f"| {sweep} | runner | examples/s (median) | min | max | engine/raw |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        chosen = [r for r in records if r["sweep"] == sweep]
        for record in chosen:
            raw = next(
                (
                    r
                    for r in chosen
                    if r["x"] == record["x"]
                    and r["runner"] == "raw"
                    and not r["error"]
                    and r["examples_per_second"] > 0
                ),
                None,
            )
            ratio = ""
            if record["runner"] == "engine" and raw and not record["error"]:
                ratio = f"{record['examples_per_second'] / raw['examples_per_second']:.3f}"
            value = (
                f"ERROR: {record['error'][:80]}" if record["error"] else f"{record['examples_per_second']:,.1f}"
            )
            lines.append(
                f"| {record['x']} | {record['runner']} | {value} | {record['min']:,.1f} "
                f"| {record['max']:,.1f} | {ratio} |"
            )
        lines.append("")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def write_plot(records, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "[sweep] matplotlib is not installed, so no sweep.png was written; install it with "
            "`pip install matplotlib` (or the package's [bench] extra). sweep.md has the numbers.",
            file=sys.stderr,
            flush=True,
        )
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, sweep, xlabel in (
        (axes[0], "steps_per_loop", "steps_per_loop"),
        (axes[1], "replicas", "replicas (logical CPUs)"),
    ):
        chosen = [r for r in records if r["sweep"] == sweep and not r["error"]]
        for runner in dict.fromkeys(r["runner"] for r in chosen):
            points = sorted(
                (r["x"], r["examples_per_second"], r["min"], r["max"]) for r in chosen if r["runner"] == runner
            )
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=runner)
        if sweep == "steps_per_loop":
            axis.set_xscale("log")
        axis.set_xticks(sorted({r["x"] for r in chosen}) or [1])
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_xlabel(xlabel)
        axis.set_ylabel("examples/s (median, min-max)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{FLAGS.model}, global batch {FLAGS.global_batch_size}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv) -> None:
    del argv
    if FLAGS.worker:
        import_tensorflow_lean()
        run_worker(FLAGS.worker)
        return
    from benchmarks.throughput import BenchConfig

    base = BenchConfig(
        model=FLAGS.model,
        runners=tuple(FLAGS.runners),
        global_batch_size=FLAGS.global_batch_size,
        warmup_steps=FLAGS.warmup_steps,
        steps=FLAGS.steps,
        repeats=FLAGS.repeats,
        peak_matmul_size=0,
    )
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    configs = _configs(base)
    payloads = _run_children(configs, FLAGS.out_dir)
    records = _rows(configs, payloads)
    command = "python -m benchmarks.sweep " + " ".join(sys.argv[1:])
    with open(os.path.join(FLAGS.out_dir, "sweep.json"), "w") as handle:
        json.dump({"command": command, "records": records, "runs": payloads}, handle, indent=2)
    write_markdown(records, os.path.join(FLAGS.out_dir, "sweep.md"), command)
    plotted = write_plot(records, os.path.join(FLAGS.out_dir, "sweep.png"))
    with open(os.path.join(FLAGS.out_dir, "sweep.md")) as handle:
        print(handle.read())
    print(f"wrote {FLAGS.out_dir}/sweep.md, sweep.json" + (", sweep.png" if plotted else ""))


if __name__ == "__main__":
    app.run(main)
