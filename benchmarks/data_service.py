r"""Input through the tf.data service against local input, the training process held to one core
(issue 51).

    python -m benchmarks.data_service --json=benchmarks/results/issue51/data_service.json

A dispatcher and one data worker (`python -m engine.data_service`) run on core 1; every
training run is a fresh process held to core 0 (`os.sched_setaffinity`, before TensorFlow
starts its threads), an `engine.Trainer` on the default strategy, timed over `--steps` steps
after `--warmup_steps` untimed ones. Two workloads, each with local input and through the
service, interleaved `--repeats` times:

- input_bound: every example is a JPEG encoded and decoded, cropped, flipped, brightened and
  resized (TensorFlow ops: the pipeline travels to the worker as a graph), for a linear model:
  local input shares core 0 with the step, the service's worker prepares it on core 1.
- compute_bound: one ready batch repeated, for a convolutional model: the step is the limit,
  and the service only adds moving each batch over loopback gRPC.

The figures are examples/s (median of the repeats) and service/local ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from engine.lean_imports import import_tensorflow_lean

TRAIN_CORE, INPUT_CORE = 0, 1
BATCH = 64
WORKLOADS = ("input_bound", "compute_bound")


def _pinned(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def _augmented(index: Any) -> Any:
    import tensorflow as tf

    seed = tf.stack([index, tf.constant(7, tf.int64)])
    raw = tf.random.stateless_uniform([128, 128, 3], seed, 0, 256, dtype=tf.int32)
    image = tf.io.decode_jpeg(tf.io.encode_jpeg(tf.cast(raw, tf.uint8), quality=90), channels=3)
    image = tf.image.stateless_random_crop(image, [112, 112, 3], seed)
    image = tf.image.stateless_random_flip_left_right(image, seed)
    image = tf.image.convert_image_dtype(image, tf.float32)
    image = tf.image.stateless_random_brightness(image, 0.2, seed)
    return tf.image.resize(image, [32, 32]), tf.cast(index % 10, tf.int32)


def _dataset(workload: str) -> Any:
    import tensorflow as tf

    if workload == "input_bound":
        indices = tf.data.Dataset.range(2**40)
        examples = indices.map(_augmented, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return examples.batch(BATCH, drop_remainder=True).prefetch(2)
    images = tf.random.stateless_uniform([BATCH, 32, 32, 3], [1, 2])
    labels = tf.range(BATCH, dtype=tf.int32) % 10
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def _model(workload: str) -> Any:
    import keras

    if workload == "input_bound":
        layers = [keras.layers.Flatten(), keras.layers.Dense(10)]
    else:
        layers = [
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    return keras.Sequential([keras.Input((32, 32, 3)), *layers])


def child(workload: str, service: str | None, warmup: int, steps: int) -> dict[str, Any]:
    """One training run in this process (held to TRAIN_CORE by its parent): its examples/s."""
    import keras
    import tensorflow as tf

    import engine

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    data = engine.GlobalBatches(
        dataset=_dataset(workload),
        service=None if service is None else engine.DataService(address=service),
    )
    trainer = engine.Trainer(
        strategy=engine.build_strategy("default"),
        model=_model(workload),
        optimizer=keras.optimizers.SGD(0.01),
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        train_data=data,
        global_batch_size=BATCH,
        cadence=engine.Cadence(steps_per_loop=10),
    )
    trainer.train(warmup)
    started = time.perf_counter()
    trainer.train(warmup + steps)
    seconds = time.perf_counter() - started
    trainer.close()
    return {"workload": workload, "service": service is not None, "examples_per_second": steps * BATCH / seconds}


def _start_service() -> tuple[list[subprocess.Popen], str]:
    """The dispatcher and one data worker on INPUT_CORE; their address once both serve."""
    python = [sys.executable, "-m", "engine.data_service"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    dispatcher = subprocess.Popen(
        [*python, "--dispatcher"], env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_pinned(INPUT_CORE)
    )
    address = _ready_address(dispatcher)
    worker = subprocess.Popen(
        [*python, "--worker", f"--dispatcher_address={address}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_pinned(INPUT_CORE),
    )
    _ready_address(worker)
    return [dispatcher, worker], address


def _ready_address(process: subprocess.Popen) -> str:
    assert process.stderr is not None
    for line in process.stderr:
        if "serving at" in line:
            return line.split("serving at ")[1].split()[0]
    raise RuntimeError(f"the server exited with {process.wait()} before serving")


def _run_child(workload: str, service: str | None, args: argparse.Namespace) -> float:
    steps = args.steps if workload == "input_bound" else args.compute_steps
    command = [sys.executable, "-m", "benchmarks.data_service", f"--child={workload}"]
    command += [f"--warmup_steps={args.warmup_steps}", f"--steps={steps}"]
    command += [f"--service={service}"] if service else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=True, preexec_fn=_pinned(TRAIN_CORE)
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["examples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="Timed steps of an input_bound run.")
    parser.add_argument("--compute_steps", type=int, default=30, help="Timed steps of a compute_bound run.")
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=WORKLOADS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--service", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import_tensorflow_lean()
        print(json.dumps(child(args.child, args.service, args.warmup_steps, args.steps)))
        return
    servers, address = _start_service()
    try:
        rates: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for workload in WORKLOADS:
                for service in (None, address):
                    key = f"{workload}/{'service' if service else 'local'}"
                    rates.setdefault(key, []).append(_run_child(workload, service, args))
                    print(f"{key}: {rates[key][-1]:.0f} examples/s", flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    medians = {key: statistics.median(values) for key, values in rates.items()}
    ratios = {w: medians[f"{w}/service"] / medians[f"{w}/local"] for w in WORKLOADS}
    for workload, ratio in ratios.items():
        print(f"{workload}: service/local = {ratio:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(
                {"runs": rates, "median_examples_per_second": medians, "service_over_local": ratios}, handle
            )


if __name__ == "__main__":
    main()
