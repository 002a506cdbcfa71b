r"""The device check: one command on a machine with GPUs, one JSON on stdout.

    benchmarks/device_check.sh                 # on a GPU machine: under 8 minutes
    benchmarks/device_check.sh --tiny          # on CPU, in seconds: the same fields

What it measures, all through `benchmarks.throughput` (engine against the bare loop,
interleaved windows in one process; nothing is measured twice here):

- ResNet-50, bfloat16 + XLA, on one GPU: the engine's and the bare loop's images/s,
  their ratio, the engine's training TFLOP/s (3x the forward FLOPs of models/flops.py)
  and its MFU against the GPU's dense bf16 peak from `PEAK_TFLOPS` (by GPU name; an
  unknown GPU has no MFU, never a guessed one).
- the same with float16 (dynamic loss scaling), against the fp16 peak;
- the bfloat16 pair mirrored over every GPU, where there are several;
- the asynchronous checkpoint's `blocking_ratio`, from `python -m benchmarks.checkpoint
  --json=PATH` where that module exists; else null, with the reason.

Each section has a share of the time budget (`--budget_s`, 420 s by default); one that
would not fit is skipped with the reason, so the command always ends with its JSON.
`--tiny` (or DEVICE_CHECK_TINY=1) runs the mlp on the CPU (two logical devices for the
mirrored part) in tiny windows: a smoke test of the command, not a measurement.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from engine.lean_imports import import_tensorflow_lean  # noqa: E402

flags.DEFINE_boolean("tiny", False, "The mlp on the CPU in tiny windows: the same JSON in seconds.")
flags.DEFINE_string("json", None, "Also write the JSON to this path.")
flags.DEFINE_integer("budget_s", 420, "Seconds the check may take; a section that would not fit is skipped.")
flags.DEFINE_integer("per_gpu_batch", 128, "ResNet-50 examples per GPU a step.")
FLAGS = flags.FLAGS

TINY_ENV = "DEVICE_CHECK_TINY"
# Dense (no sparsity) tensor-core peaks per GPU in TFLOP/s, from NVIDIA's datasheets:
# (name pattern, bfloat16, float16). First match wins: the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float | None, float | None], ...] = (
    (r"H200", 989.0, 989.0),
    (r"H100.*PCIe", 756.0, 756.0),
    (r"H100.*NVL", 835.0, 835.0),
    (r"H100", 989.0, 989.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (r"A100", 312.0, 312.0),
    (r"L40S", 362.0, 362.0),
    (r"L40\b", 181.0, 181.0),
    (r"\bL4\b", 121.0, 121.0),
    (r"\bA10\b", 125.0, 125.0),
    (r"V100", None, 125.0),  # No bfloat16 tensor cores.
    (r"\bT4\b", None, 65.0),
)
# Every field of the JSON (test_benchmarks checks them); a section's own fields: SECTION_FIELDS.
FIELDS = (
    "tiny",
    "model",
    "devices",
    "device_count",
    "peak_tflops_per_device",
    "bf16_xla",
    "fp16_xla",
    "mirrored_bf16_xla",
    "async_checkpoint",
    "wall_s",
)
SECTION_FIELDS = (
    "replicas",
    "global_batch_size",
    "engine_images_per_second",
    "raw_images_per_second",
    "engine/raw",
    "engine_tflops",
    "mfu",
    "error",
)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak of one GPU of that name at `dtype` ("bfloat16", "float16"); None: unknown."""
    for pattern, bf16, fp16 in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return bf16 if dtype == "bfloat16" else fp16
    return None


def _log(message: str) -> None:
    print(f"[device_check] {message}", file=sys.stderr, flush=True)


def _devices(tiny: bool) -> list[str]:
    """The GPUs' names (the CPU's logical devices in tiny mode)."""
    import tensorflow as tf

    if tiny:
        return [f"CPU:{index}" for index in range(len(tf.config.list_logical_devices("CPU")))]
    names = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        names.append(str(details.get("device_name", gpu.name)))
    return names


def _section(config: Any, engine: str, raw: str, peak_per_device: float | None) -> dict[str, Any]:
    """One engine-vs-raw pair through benchmarks.throughput, as the check reports it."""
    from benchmarks.throughput import run_benchmark

    payload = run_benchmark(config)
    rows = {row["runner"]: row for row in payload["results"]}
    engine_row, raw_row = rows[engine], rows[raw]
    errors = [f"{name}: {row['error']}" for name, row in ((engine, engine_row), (raw, raw_row)) if row["error"]]
    engine_rate = engine_row["examples_per_second"] or None
    raw_rate = raw_row["examples_per_second"] or None
    replicas = engine_row["replicas"]
    tflops = engine_row["achieved_tflops"] if engine_rate and engine_row["flops_per_example"] else None
    peak = peak_per_device * replicas if peak_per_device else None
    return {
        "replicas": replicas,
        "global_batch_size": config.global_batch_size,
        "engine_images_per_second": engine_rate,
        "raw_images_per_second": raw_rate,
        "engine/raw": engine_rate / raw_rate if engine_rate and raw_rate else None,
        "engine_tflops": tflops,
        "mfu": tflops / peak if tflops and peak else None,  # Unknown peak: no MFU.
        "error": "; ".join(errors) or None,
    }


def _guarded(section: Any, *args: Any) -> dict[str, Any]:
    """A section's figures, or its error: the check always ends with its JSON."""
    try:
        return section(*args)
    except Exception as error:  # noqa: BLE001 -- reported in the JSON, the other sections still run
        return {**dict.fromkeys(SECTION_FIELDS), "error": f"{type(error).__name__}: {error}"[:500]}


def _skipped(reason: str) -> dict[str, Any]:
    return {**dict.fromkeys(SECTION_FIELDS), "error": None, "skipped": reason}


def _async_checkpoint(seconds: float, tiny: bool) -> dict[str, Any]:
    """`blocking_ratio` of `python -m benchmarks.checkpoint --json=PATH`, or null and why."""
    if importlib.util.find_spec("benchmarks.checkpoint") is None:
        return {"blocking_ratio": None, "reason": "benchmarks/checkpoint.py does not exist in this checkout"}
    if seconds < 10:
        return {"blocking_ratio": None, "reason": f"skipped: {seconds:.0f} s of the time budget left"}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.json")
        # Tiny: the benchmark's own smallest settings (its smoke test's), not resnet50's defaults.
        tiny_sizes = ["--model=mlp", "--global_batch_size=16", "--saves=2", "--steps=4", "--checkpoint_every=2",
                      "--repeats=1", f"--model_dir={os.path.join(directory, 'checkpoints')}"]  # fmt: skip
        sizes = tiny_sizes if tiny else []
        try:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.checkpoint", f"--json={path}", *sizes],
                stdout=sys.stderr,  # Its table goes with the logs; stdout holds only the JSON.
                timeout=seconds,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"blocking_ratio": None, "reason": f"benchmarks.checkpoint ran past {seconds:.0f} s"}
        if done.returncode != 0:
            return {"blocking_ratio": None, "reason": f"benchmarks.checkpoint exited with {done.returncode}"}
        try:
            with open(path) as handle:
                ratio = json.load(handle)["blocking_ratio"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            return {"blocking_ratio": None, "reason": f"no blocking_ratio in its JSON: {error}"}
    return {"blocking_ratio": ratio}


def run_check(*, tiny: bool, budget_s: float, per_gpu_batch: int) -> dict[str, Any]:
    """Every section within `budget_s` seconds; returns the JSON's object."""
    from benchmarks.throughput import BenchConfig

    began = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - began)

    devices = _devices(tiny)
    count = len(devices)
    if tiny:
        base = BenchConfig(
            model="mlp", strategy="default", global_batch_size=16, steps_per_loop=2, warmup_steps=2, steps=4,
            repeats=1, peak_matmul_size=0, cpu_devices=1,
        )  # fmt: skip
    else:
        # Windows long enough for a steady rate, short enough for four XLA compilations of ResNet-50.
        base = BenchConfig(
            model="resnet50", strategy="one_device", global_batch_size=per_gpu_batch, steps_per_loop=10,
            warmup_steps=20, steps=50, repeats=3, peak_matmul_size=0,
        )  # fmt: skip
    name = devices[0] if devices else ""
    peaks = {dtype: (None if tiny else peak_tflops(name, dtype)) for dtype in ("bfloat16", "float16")}
    result: dict[str, Any] = {
        "tiny": tiny,
        "model": base.model,
        "devices": devices,
        "device_count": count,
        "peak_tflops_per_device": peaks,
    }
    if not tiny and count == 0:
        reason = "no GPU visible to TensorFlow"
        result.update(bf16_xla=_skipped(reason), fp16_xla=_skipped(reason), mirrored_bf16_xla=_skipped(reason))
    else:
        pairs = (
            ("bf16_xla", "engine_bf16_jit", "raw_bf16_jit", "bfloat16"),
            ("fp16_xla", "engine_fp16_jit", "raw_fp16_jit", "float16"),
        )
        spent: list[float] = []
        for key, engine, raw, dtype in pairs:
            if spent and left() < 1.5 * spent[0]:
                result[key] = _skipped(f"skipped: {left():.0f} s of the time budget left")
                continue
            started = time.monotonic()
            _log(f"{key}: {engine} against {raw}")
            config = _replace(base, runners=(engine, raw))
            result[key] = _guarded(_section, config, engine, raw, peaks[dtype])
            spent.append(time.monotonic() - started)
        if count < 2:
            result["mirrored_bf16_xla"] = _skipped("one device: nothing to mirror over")
        elif left() < 1.5 * spent[0]:
            result["mirrored_bf16_xla"] = _skipped(f"skipped: {left():.0f} s of the time budget left")
        else:
            _log(f"mirrored_bf16_xla over {count} devices")
            batch = base.global_batch_size * (1 if tiny else count)
            config = _replace(
                base,
                strategy="mirrored",
                cpu_devices=count if tiny else 1,
                global_batch_size=batch,
                runners=("engine_bf16_jit", "raw_bf16_jit"),
            )
            result["mirrored_bf16_xla"] = _guarded(
                _section, config, "engine_bf16_jit", "raw_bf16_jit", peaks["bfloat16"]
            )
    checkpoint_seconds = max(left(), 0.0) if not tiny else min(max(left(), 0.0), 120.0)
    result["async_checkpoint"] = _async_checkpoint(checkpoint_seconds, tiny)
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


def _replace(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)


def main(argv: list[str]) -> None:
    del argv
    import_tensorflow_lean()
    tiny = FLAGS.tiny or os.environ.get(TINY_ENV) == "1"
    if tiny:  # Two logical CPUs for the mirrored part, before anything touches a device.
        from engine import configure_cpu_devices

        configure_cpu_devices(2)
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the JSON alone.
        result = run_check(tiny=tiny, budget_s=FLAGS.budget_s, per_gpu_batch=FLAGS.per_gpu_batch)
    text = json.dumps(result, sort_keys=False)
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as handle:
            handle.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    app.run(main)
