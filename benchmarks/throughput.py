r"""Training throughput: the engine's loop against Keras `fit` and a bare loop.

    python -m benchmarks.throughput --model=cnn --strategy=default \
        --runners=engine,fit,raw --json=benchmarks/out/cnn.json

Every runner trains the same model (a fresh copy, same seed), on the same
synthetic data, batch, optimizer (Adam, lr 1e-3) and strategy, in ONE process;
timed windows are interleaved (engine, fit, raw, engine, fit, raw, ...) so
that drift of a shared machine hits every runner alike.

Runners:

- `engine`: `engine.Trainer` as the CLI runs it: the `input` package's
  synthetic source kept on the replicas' devices (`ResidentData`; with the
  `_stream` suffix, through the per-replica tf.data path instead),
  per-example sparse cross-entropy, an accuracy metric, no model_dir, no
  eval. A window is the wall time of `trainer.train(target)`.
- `fit`: `model.fit` under the same strategy, with `steps_per_execution`
  = `--fit_steps_per_execution` (default: `--steps_per_loop`); when that
  fails (Keras 3 + MirroredStrategy: the unbuilt-optimizer placeholder bug,
  keras-team/keras#23085) it falls back to 1 and
  records the error. A window is one epoch of `--steps` steps, timed by a
  callback from epoch begin to end (the per-`fit`-call set-up, which a real
  run pays once, is left out). If fit cannot run at all, its row carries the
  error.
- `raw`: the smallest compiled loop: one `tf.function` with a `tf.range`
  loop over `strategy.run(step)` on one in-memory batch (reused every step),
  no metric: the ceiling the engine's overhead is measured against.
- `tfdata` (with `--data=tfrecord` only): the peer on files. A plain tf.data
  reader of the same TFRecord files, tuned the way a user would tune it
  (parallel interleave, shuffle buffer, parallel map, batch, prefetch, all
  AUTOTUNE and non-deterministic), distributed with
  `strategy.experimental_distribute_dataset` and trained by the raw loop's
  compiled step (no metric).

Data (`--data`):

- `synthetic` (default): the `input` package's in-memory synthetic source.
- `tfrecord`: `--tfrecord_examples` synthetic images at the model's input
  shape, PNG-encoded into `--tfrecord_files` files train-00000-of-000NN of
  tf.train.Example records (`input.write_tfrecords`), read by every runner:
  the engine through the `tfrecord` source exactly as `--dataset=tfrecord`
  does, fit through the same source, raw from one batch of it. The files go
  to `--tfrecord_dir` (kept, and reused by later runs with the same data
  settings) or to a temporary directory removed at the end.

A runner name may carry suffixes that override the global flags for that
runner alone: `_bf16`, `_fp16`, `_fp32` (mixed precision) and `_jit`,
`_nojit` (XLA), e.g. `--runners=engine,fit,raw,engine_bf16_jit`, so the
fastest engine setting and the float32 peers are measured in the same run.

Also reported: model FLOPs per example (3x forward for a training step),
achieved TFLOP/s, and the peak of a large `tf.matmul` (float32, and bfloat16
when any runner uses it) on the same devices, measured in the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from engine.cli.config.settings import PRECISION_POLICIES  # noqa: E402  (pure Python: no TensorFlow yet)
from engine.lean_imports import import_tensorflow_lean  # noqa: E402
from engine.options import Cadence, StepOptions  # noqa: E402  (pure Python too)

RUNNER_KINDS = ("engine", "fit", "raw", "tfdata")
DEFAULT_RUNNERS = ("engine", "fit", "raw")
DATA_MODES = ("synthetic", "tfrecord")
# Written last into --tfrecord_dir: the data settings of the files beside it.
RECORDS_MANIFEST = "benchmark_records.json"
_RECORDS_SEED = 12345  # fixed, like the synthetic source's: the data must not change with --seed
_PRECISION_SUFFIXES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
LEARNING_RATE = 1e-3

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The CLI flags, one per `BenchConfig` field (its default and help); defined only when
    run as a script, so importing this module (the sweep does) defines none."""
    for setting in dataclasses.fields(BenchConfig):
        help_text, choices = setting.metadata["help"], setting.metadata.get("choices")
        default = setting.default
        if choices:
            flags.DEFINE_enum(setting.name, default, list(choices), help_text)
        elif isinstance(default, bool):
            flags.DEFINE_boolean(setting.name, default, help_text)
        elif isinstance(default, tuple):
            flags.DEFINE_list(setting.name, list(default), help_text)
        elif setting.metadata.get("integer"):
            flags.DEFINE_integer(setting.name, default, help_text)
        else:
            flags.DEFINE_string(setting.name, default, help_text)
    flags.DEFINE_string("json", None, "Write the results as JSON to this path.")


def _option(default: Any, help_text: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A BenchConfig field and its flag (`define_flags`): the default and help, in one place."""
    integer = isinstance(default, int) and not isinstance(default, bool)
    return field(default=default, metadata={"help": help_text, "choices": choices, "integer": integer})


# --------------------------------------------------------------------- config


@dataclass(frozen=True)
class BenchConfig:
    model: str = _option("cnn", "Model name from the models registry (cnn, resnet50, wide_mlp, ...).")
    strategy: str = _option("default", "default, one_device or mirrored.")
    runners: tuple[str, ...] = _option(
        DEFAULT_RUNNERS,
        "Runners, in interleaving order: engine, fit, raw, tfdata (--data=tfrecord), each "
        "optionally with suffixes _bf16/_fp16/_fp32 and _jit/_nojit.",
    )
    global_batch_size: int = _option(64, "Global batch size (all replicas).")
    steps_per_loop: int = _option(50, "Engine steps per compiled call (also the raw loop's).")
    fit_steps_per_execution: int | None = field(
        default=None,
        metadata={
            "help": "Keras fit steps_per_execution to try first (default: --steps_per_loop).",
            "integer": True,
        },
    )
    cpu_devices: int = _option(1, "Logical CPU devices (replicas of --strategy=mirrored).")
    jit_compile: bool = _option(False, "XLA-compile the forward/backward pass.")
    mixed_precision: str = _option("float32", "Compute precision.", choices=tuple(PRECISION_POLICIES))
    warmup_steps: int = _option(100, "Untimed steps per runner (tracing, compiling, warm caches).")
    steps: int = _option(200, "Steps per timed window.")
    repeats: int = _option(5, "Timed windows per runner (interleaved across runners).")
    num_classes: int = _option(10, "Classes of the synthetic data.")
    seed: int = _option(42, "Seed of every model and of the data stream.")
    peak_matmul_size: int = _option(2048, "Side of the square matmul that measures peak FLOP/s (0: skip).")
    data: str = _option("synthetic", "In-memory synthetic data or TFRecord files of it.", choices=DATA_MODES)
    tfrecord_dir: str | None = field(
        default=None,
        metadata={
            "help": "--data=tfrecord: where the record files are written (kept and reused by later runs "
            "with the same data settings); default: a temporary directory removed at the end."
        },
    )
    tfrecord_examples: int = _option(4096, "--data=tfrecord: train records to write.")
    tfrecord_files: int = _option(8, "--data=tfrecord: files the records are split into.")


def check_config(config: BenchConfig) -> None:
    """Fail on a typo or an impossible combination before minutes of set-up."""
    if config.data not in DATA_MODES:
        raise ValueError(f"unknown data mode {config.data!r}; use one of {DATA_MODES}")
    specs = [parse_runner(token, config) for token in config.runners]
    if config.data != "tfrecord" and any(spec.kind == "tfdata" for spec in specs):
        raise ValueError("the tfdata runner reads TFRecord files: add --data=tfrecord")
    if config.data == "tfrecord":
        if config.tfrecord_files < 1 or config.tfrecord_examples < config.tfrecord_files:
            raise ValueError(
                f"--tfrecord_files={config.tfrecord_files} and --tfrecord_examples="
                f"{config.tfrecord_examples}: need at least one file and one record per file"
            )
        if config.tfrecord_examples < config.global_batch_size:
            raise ValueError(
                f"--tfrecord_examples={config.tfrecord_examples} is smaller than "
                f"--global_batch_size={config.global_batch_size}; write at least one batch"
            )


@dataclass(frozen=True)
class RunnerSpec:
    name: str  # as given on the command line, e.g. "engine_bf16_jit"
    kind: str  # engine | fit | raw | tfdata
    mixed_precision: str
    jit_compile: bool
    streamed: bool = False  # engine only: batches through the tf.data iterator, not kept on the devices


def parse_runner(token: str, config: BenchConfig) -> RunnerSpec:
    """`engine_bf16_jit` -> RunnerSpec(kind=engine, bfloat16, jit)."""
    parts = token.strip().split("_")
    kind, suffixes = parts[0], parts[1:]
    if kind not in RUNNER_KINDS:
        raise ValueError(f"unknown runner {token!r}; the name must start with one of {RUNNER_KINDS}")
    precision, jit, streamed = config.mixed_precision, config.jit_compile, False
    for suffix in suffixes:
        if suffix in _PRECISION_SUFFIXES:
            precision = _PRECISION_SUFFIXES[suffix]
        elif suffix == "jit":
            jit = True
        elif suffix == "nojit":
            jit = False
        elif suffix == "stream" and kind == "engine":
            streamed = True
        else:
            raise ValueError(
                f"unknown suffix {suffix!r} in runner {token!r}; use _bf16, _fp16, _fp32, _jit, _nojit "
                "or (engine only) _stream"
            )
    return RunnerSpec(token.strip(), kind, precision, jit, streamed)


# -------------------------------------------------------------------- runners


@dataclass
class Runner:
    """Builds its own fresh model in `setup`, then times windows of steps."""

    spec: RunnerSpec
    config: BenchConfig
    strategy: Any
    source: Any
    model_spec: Any
    files: tuple[str, ...] = ()  # --data=tfrecord: the train record files
    model: Any = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def _build(self):
        """A fresh model and Adam, same seed, under this runner's precision."""
        import keras

        from engine.cli.process.environment import seed_everything, set_precision

        set_precision(self.spec.mixed_precision)
        seed_everything(self.config.seed)
        with self.strategy.scope():
            model = self.model_spec.build(self.model_spec.default_input_shape, self.config.num_classes)
            optimizer = keras.optimizers.Adam(LEARNING_RATE)
            if self.spec.mixed_precision == "float16":
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        self.model = model
        return model, optimizer

    def setup(self) -> None:
        raise NotImplementedError

    def window(self, steps: int) -> float:
        """Trains `steps` steps; returns the seconds they took."""
        raise NotImplementedError


def _loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


class EngineRunner(Runner):
    def setup(self) -> None:
        import keras

        from engine import Trainer
        from engine.cli.config.settings import DEFAULT_DEVICE_DATA_MB
        from engine.cli.run.job import resident_train_data

        model, optimizer = self._build()
        config, source = self.config, self.source

        # The CLI's input paths (engine/cli/run/job.py): an in-memory split kept on the
        # devices by default, the per-replica tf.data pipeline with `_stream`.
        def streamed(input_context, start_step):
            return source.train_dataset(
                global_batch_size=config.global_batch_size,
                seed=config.seed,
                start_step=start_step,
                input_context=input_context,
            )

        train_data = streamed
        if not self.spec.streamed:
            train_data = (
                resident_train_data(
                    source,
                    global_batch_size=config.global_batch_size,
                    seed=config.seed,
                    device_data_mb=DEFAULT_DEVICE_DATA_MB,
                    host_data=streamed,
                )
                or streamed
            )  # TFRecord files: no in-memory split.

        self.trainer = Trainer(
            strategy=self.strategy,
            model=model,
            optimizer=optimizer,
            train_data=train_data,
            global_batch_size=config.global_batch_size,
            loss_fn=_loss_fn(),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            cadence=Cadence(steps_per_loop=config.steps_per_loop),
            step=StepOptions(jit_compile=self.spec.jit_compile),
        )
        self.trainer.train(max(1, self.config.warmup_steps))
        self.extra["steps_per_loop"] = config.steps_per_loop
        self.extra["input"] = "resident" if self.trainer.keeps_data_on_devices else "tf.data"

    def window(self, steps: int) -> float:
        target = self.trainer.step + steps
        began = time.perf_counter()
        self.trainer.train(target)
        return time.perf_counter() - began


class FitRunner(Runner):
    def setup(self) -> None:
        import keras

        preferred = self.config.fit_steps_per_execution or self.config.steps_per_loop
        attempts = [(preferred, self.spec.jit_compile)]
        if preferred > 1:
            attempts.append((1, self.spec.jit_compile))
        if self.spec.jit_compile:
            attempts.append((1, False))
        errors = []
        for steps_per_execution, jit in attempts:
            try:
                model, optimizer = self._build()
                model.compile(
                    optimizer=optimizer,
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                    steps_per_execution=steps_per_execution,
                    jit_compile=jit,
                )
                self.dataset = self.source.train_dataset(
                    global_batch_size=self.config.global_batch_size, seed=self.config.seed
                )
                warmup = max(steps_per_execution, self.config.warmup_steps)
                model.fit(self.dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
            except Exception as error:  # noqa: BLE001 -- recorded, not hidden
                errors.append(
                    f"steps_per_execution={steps_per_execution} jit_compile={jit}: "
                    f"{type(error).__name__}: {_first_line(error)}"
                )
                continue
            self.extra.update(
                steps_per_execution=steps_per_execution,
                fit_jit_compile=jit,
                fallback_error=" | ".join(errors) or None,
            )
            self.used_jit = jit
            return
        self.error = " | ".join(errors)

    def window(self, steps: int) -> float:
        import keras

        class EpochTimer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.began = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds = time.perf_counter() - self.began

        timer = EpochTimer()
        self.model.fit(self.dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        return timer.seconds


def _raw_step(runner: Runner, model, optimizer):
    """The bare per-replica step of the raw and tfdata runners: forward,
    per-example loss averaged over the global batch, apply; no metric."""
    import tensorflow as tf

    config = runner.config
    with runner.strategy.scope():
        optimizer.build(model.trainable_variables)
    loss_fn = _loss_fn()
    variables = model.trainable_variables
    uses_loss_scale = runner.spec.mixed_precision == "float16"

    def gradients(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(
                tf.cast(loss_fn(y, logits), tf.float32), global_batch_size=config.global_batch_size
            )
            if uses_loss_scale:
                loss = optimizer.scale_loss(loss)
        return tape.gradient(loss, variables)

    if runner.spec.jit_compile:  # Same split as the engine: XLA for forward/backward only.
        gradients = tf.function(gradients, jit_compile=True)

    def step(x, y):
        optimizer.apply(gradients(x, y), variables)

    return step


def _time_loop(loop, optimizer, steps: int, steps_per_loop: int, *args) -> float:
    """Seconds for `steps` steps of `loop(*args, num_steps)`, in calls of at
    most `steps_per_loop` steps, until the last update has landed."""
    import tensorflow as tf

    began = time.perf_counter()
    done = 0
    while done < steps:
        length = min(steps_per_loop, steps - done)
        loop(*args, tf.constant(length, tf.int32))
        done += length
    int(optimizer.iterations.numpy())  # Wait for the last update.
    return time.perf_counter() - began


class RawRunner(Runner):
    def setup(self) -> None:
        import tensorflow as tf

        model, optimizer = self._build()
        strategy, config = self.strategy, self.config
        step = _raw_step(self, model, optimizer)
        features, labels = next(
            iter(self.source.train_dataset(global_batch_size=config.global_batch_size, seed=config.seed))
        )
        per_replica = config.global_batch_size // strategy.num_replicas_in_sync

        def shard(tensor):
            def value_fn(context):
                first = context.replica_id_in_sync_group * per_replica
                return tf.identity(tensor[first : first + per_replica])

            return strategy.experimental_distribute_values_from_function(value_fn)

        x, y = shard(features), shard(labels)

        @tf.function
        def loop(num_steps):
            for _ in tf.range(num_steps):
                strategy.run(step, args=(x, y))

        self.loop, self.optimizer = loop, optimizer
        self.window(max(1, config.warmup_steps))
        self.extra["steps_per_loop"] = config.steps_per_loop

    def window(self, steps: int) -> float:
        return _time_loop(self.loop, self.optimizer, steps, self.config.steps_per_loop)


TFDATA_CYCLE_LENGTH = 4  # files read at once
TFDATA_SHUFFLE_BUFFER = 1024


def tuned_tfrecord_dataset(files, image_shape: tuple[int, int, int], global_batch_size: int, seed: int):
    """Global batches of the record files, read the way a tuned tf.data user
    would: everything parallel, AUTOTUNEd and free to reorder."""
    import tensorflow as tf

    features = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        image = tf.io.decode_png(example["image"], channels=image_shape[-1])
        image = tf.ensure_shape(tf.image.convert_image_dtype(image, tf.float32), image_shape)
        return image, tf.cast(example["label"], tf.int32)

    return (
        tf.data.Dataset.from_tensor_slices(list(files))
        .shuffle(len(files), seed=seed)
        .interleave(
            tf.data.TFRecordDataset,
            cycle_length=min(TFDATA_CYCLE_LENGTH, len(files)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=False,
        )
        .shuffle(TFDATA_SHUFFLE_BUFFER, seed=seed)
        .repeat()
        .map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
        .batch(global_batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


class TFDataRunner(Runner):
    """The hand-tuned tf.data reader of the record files, trained by the raw
    runner's compiled step and loop."""

    def setup(self) -> None:
        import tensorflow as tf

        model, optimizer = self._build()
        strategy, config = self.strategy, self.config
        step = _raw_step(self, model, optimizer)
        dataset = tuned_tfrecord_dataset(
            self.files, self.model_spec.default_input_shape, config.global_batch_size, config.seed
        )
        self.iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def loop(iterator, num_steps):
            for _ in tf.range(num_steps):
                strategy.run(step, args=next(iterator))

        self.loop, self.optimizer = loop, optimizer
        self.window(max(1, config.warmup_steps))
        self.extra.update(
            steps_per_loop=config.steps_per_loop,
            cycle_length=min(TFDATA_CYCLE_LENGTH, len(self.files)),
            shuffle_buffer=TFDATA_SHUFFLE_BUFFER,
        )

    def window(self, steps: int) -> float:
        return _time_loop(self.loop, self.optimizer, steps, self.config.steps_per_loop, self.iterator)


RUNNER_CLASSES = {"engine": EngineRunner, "fit": FitRunner, "raw": RawRunner, "tfdata": TFDataRunner}


# ------------------------------------------------------------------ peak flops


def measure_peak_tflops(strategy, dtype: str, size: int, matmuls: int = 4, repeats: int = 3) -> float:
    """Best TFLOP/s of a chain of `size`^2 matmuls, run on every replica at once."""
    import tensorflow as tf

    tf_dtype = tf.as_dtype(dtype)

    def make(context):
        generator = tf.random.Generator.from_seed(context.replica_id_in_sync_group)
        return tf.cast(generator.normal([size, size], stddev=1.0 / math.sqrt(size)), tf_dtype)

    a = strategy.experimental_distribute_values_from_function(make)
    b = strategy.experimental_distribute_values_from_function(make)

    def chain(a, x):
        for _ in range(matmuls):  # Each depends on the last: nothing to fold.
            x = tf.matmul(a, x)
        return tf.reduce_sum(tf.cast(x[:1, :1], tf.float32))

    @tf.function
    def run(a, b):
        return strategy.run(chain, args=(a, b))

    def once() -> float:
        began = time.perf_counter()
        result = run(a, b)
        for value in strategy.experimental_local_results(result):
            value.numpy()
        return time.perf_counter() - began

    once()
    best = min(once() for _ in range(repeats))
    flops = 2.0 * size**3 * matmuls * strategy.num_replicas_in_sync
    return flops / best / 1e12


# ------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    import keras
    import tensorflow as tf

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cpu_count": os.cpu_count(),
        "logical_cpu_devices": len(tf.config.list_logical_devices("CPU")),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo") as handle:
            text = handle.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        cpu_flags = next(
            (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
        )
        info["cpu_flags"] = sorted(
            f for f in cpu_flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2", "fma"))
        )
    except OSError:
        pass
    return info


# ---------------------------------------------------------------------- main


def _first_line(error: BaseException) -> str:
    """The informative part of an error, on one short line.

    TF graph errors start with "Graph execution error:" and a traceback;
    the cause ("You must feed a value for placeholder tensor ...") comes
    after it, so such errors keep their first line and the cause."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        causes = [
            line
            for line in lines[1:]
            if not line.startswith(("File ", "Detected at node", "[["))
            and "Traceback" not in line
            and not line.startswith(("return ", "self.", "raise "))
        ]
        if causes:
            text += " " + max(causes, key=len)
    return text[:500]


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Runs every runner of `config`; returns the JSON payload.

    `configure_cpu_devices` must already have run when `config.cpu_devices`
    > 1 (before anything touched a TF device): `main` does it first.
    """
    from engine import build_strategy
    from input import get_data_source
    from models import get_model_spec

    check_config(config)
    strategy = build_strategy(config.strategy, cpu_devices=config.cpu_devices)
    model_spec = get_model_spec(config.model)
    image_shape = model_spec.default_input_shape
    if config.data == "synthetic":
        source = get_data_source("synthetic", image_shape=image_shape, num_classes=config.num_classes)
        data = {"mode": "synthetic", "records": source.num_train_examples}
        return _measure(config, strategy, model_spec, source, (), data)
    with _records_directory(config.tfrecord_dir) as directory:
        data = prepare_records(config, image_shape, directory)
        source = get_data_source(
            "tfrecord", image_shape=image_shape, num_classes=config.num_classes, data_dir=directory
        )
        files = tuple(os.path.join(directory, name) for name in data["file_names"])
        return _measure(config, strategy, model_spec, source, files, data)


@contextlib.contextmanager
def _records_directory(directory: str | None) -> Iterator[str]:
    """`directory` (created if missing, kept), or a temporary one removed at the end."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        yield directory
        return
    temporary = tempfile.mkdtemp(prefix="throughput-records-")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def prepare_records(config: BenchConfig, image_shape: tuple[int, ...], directory: str) -> dict[str, Any]:
    """Writes the record files into `directory`, or reuses those a run with
    the same data settings wrote there (its manifest says so); returns the
    payload's `data` fields. Refuses a directory with train* or eval* files
    of its own: the tfrecord source would read them with ours, and writing
    ours would overwrite them."""
    import numpy as np

    from input import write_tfrecords

    count = config.tfrecord_files
    settings = {
        "image_shape": list(image_shape),
        "num_classes": config.num_classes,
        "records": config.tfrecord_examples,
        "files": count,
        "file_names": [f"train-{index:05d}-of-{count:05d}" for index in range(count)],
        "seed": _RECORDS_SEED,
    }
    data = {"mode": "tfrecord", "directory": os.path.abspath(directory), "kept": bool(config.tfrecord_dir)}
    manifest = os.path.join(directory, RECORDS_MANIFEST)
    previous = None
    if os.path.exists(manifest):
        with open(manifest) as handle:
            try:
                previous = json.load(handle)
            except ValueError:  # Cut short while written: its files count as not ours.
                previous = None
    present = {name for name in os.listdir(directory) if name.startswith(("train", "eval"))}
    if previous == settings and present == set(settings["file_names"]):
        _log(f"reusing {count} record files in {directory}")
        return {**data, **settings, "written": False, "write_seconds": 0.0}
    ours = set(previous.get("file_names", [])) if isinstance(previous, dict) else set()
    if present - ours:
        raise ValueError(
            f"--tfrecord_dir={directory} holds files the benchmark did not write "
            f"({sorted(present - ours)[0]}); use an empty or new directory"
        )
    if os.path.exists(manifest):
        os.remove(manifest)  # First: a run cut short must not look complete.
    for name in present:
        os.remove(os.path.join(directory, name))
    began = time.perf_counter()
    bounds = np.linspace(0, config.tfrecord_examples, count + 1).astype(int)
    for index, name in enumerate(settings["file_names"]):
        rng = np.random.RandomState([_RECORDS_SEED, index])
        size = int(bounds[index + 1] - bounds[index])
        images = rng.randint(0, 256, size=(size, *image_shape), dtype=np.uint8)
        labels = rng.randint(0, config.num_classes, size=size)
        write_tfrecords(os.path.join(directory, name), images, labels)
    with open(manifest, "w") as handle:
        json.dump(settings, handle, indent=2)
    seconds = time.perf_counter() - began
    _log(f"wrote {config.tfrecord_examples} records in {count} files to {directory} in {seconds:.1f} s")
    return {**data, **settings, "written": True, "write_seconds": round(seconds, 2)}


def _measure(
    config: BenchConfig, strategy, model_spec, source, files: tuple[str, ...], data: dict
) -> dict[str, Any]:
    """Sets up the runners, times their interleaved windows, measures the peak."""
    specs = [parse_runner(token, config) for token in config.runners]
    runners = [_set_up(spec, config, strategy, model_spec, source, files) for spec in specs]
    windows = _time_windows(config, runners)
    peaks = _measure_peaks(config, strategy, specs)
    rows = [
        _row(runner, config, windows[runner.spec.name], peaks, strategy.num_replicas_in_sync)
        for runner in runners
    ]
    return {
        "results": rows,
        "ratios": compute_ratios(rows),
        "peak_tflops": peaks.get("float32", 0.0),
        "peak_tflops_by_dtype": peaks,
        "config": {**config.__dict__, "runners": list(config.runners)},
        "data": data,
        "machine": machine_info(),
    }


def _set_up(
    spec: RunnerSpec, config: BenchConfig, strategy, model_spec, source, files: tuple[str, ...]
) -> Runner:
    """One runner, set up and its setup timed; an error in setup is its row's error, not a crash."""
    runner = RUNNER_CLASSES[spec.kind](
        spec=spec, config=config, strategy=strategy, source=source, model_spec=model_spec, files=files
    )
    began = time.perf_counter()
    try:
        runner.setup()
    except Exception as error:  # noqa: BLE001 -- a row with the error, not a crash
        runner.error = f"{type(error).__name__}: {_first_line(error)}"
    runner.extra["setup_seconds"] = round(time.perf_counter() - began, 2)
    _log(
        f"set up {spec.name}: {runner.extra['setup_seconds']} s"
        + (f"  ERROR {runner.error}" if runner.error else "")
    )
    return runner


def _time_windows(config: BenchConfig, runners: list[Runner]) -> dict[str, list[float]]:
    """Each runner's examples/s in each repeat, the runners interleaved within a repeat."""
    windows: dict[str, list[float]] = {runner.spec.name: [] for runner in runners}
    for repeat in range(config.repeats):
        for runner in runners:
            if runner.error:
                continue
            try:
                seconds = runner.window(config.steps)
            except Exception as error:  # noqa: BLE001
                runner.error = f"{type(error).__name__}: {_first_line(error)}"
                continue
            rate = config.steps * config.global_batch_size / seconds
            windows[runner.spec.name].append(rate)
            _log(f"repeat {repeat + 1}/{config.repeats} {runner.spec.name}: {rate:,.1f} examples/s")
    return windows


def _measure_peaks(config: BenchConfig, strategy, specs: list[RunnerSpec]) -> dict[str, float]:
    """The peak matmul TFLOP/s of each dtype the runners compute in (none: peak_matmul_size 0)."""
    import tensorflow as tf

    from engine.cli.process.environment import set_precision

    peaks: dict[str, float] = {}
    if config.peak_matmul_size <= 0:
        return peaks
    set_precision("float32")
    replicas = strategy.num_replicas_in_sync
    dtypes = ["float32"] + (["bfloat16"] if any(s.mixed_precision == "bfloat16" for s in specs) else [])
    single = tf.distribute.OneDeviceStrategy("/cpu:0")
    for dtype in dtypes:
        try:
            # All replicas at once, and one device alone (logical CPUs share
            # the cores, so either can be the higher): the peak is the best.
            on_replicas = measure_peak_tflops(strategy, dtype, config.peak_matmul_size)
            peaks[dtype] = on_replicas
            if replicas > 1:
                alone = measure_peak_tflops(single, dtype, config.peak_matmul_size)
                peaks[dtype] = max(on_replicas, alone)
                _log(f"peak {dtype}: {on_replicas:.3f} on {replicas} replicas, {alone:.3f} on one device")
        except Exception as error:  # noqa: BLE001
            _log(f"peak {dtype} failed: {error}")
    _log("peak TFLOP/s: " + ", ".join(f"{k}={v:.3f}" for k, v in peaks.items()))
    return peaks


def _row(
    runner: Runner, config: BenchConfig, rates: list[float], peaks: dict[str, float], replicas: int
) -> dict:
    """A runner's row of the results: its median rate, its FLOPs and their fraction of the peak."""
    from models import flops_per_example

    flops = 0
    if runner.model is not None:
        try:
            flops = int(flops_per_example(runner.model))
        except Exception as error:  # noqa: BLE001
            runner.extra["flops_error"] = str(error)
    median = statistics.median(rates) if rates else 0.0
    achieved = 3 * flops * median / 1e12
    compute_dtype = "bfloat16" if runner.spec.mixed_precision == "bfloat16" else "float32"
    peak = peaks.get(compute_dtype)
    jit = runner.spec.jit_compile
    if runner.spec.kind == "fit" and hasattr(runner, "used_jit"):
        jit = runner.used_jit
    error = runner.error
    if not rates and error is None:
        error = "no timed window completed"
    return {
        "runner": runner.spec.name,
        "kind": runner.spec.kind,
        "model": config.model,
        "strategy": config.strategy,
        "examples_per_second": median,
        "min": min(rates) if rates else 0.0,
        "max": max(rates) if rates else 0.0,
        "windows": rates,
        "global_batch_size": config.global_batch_size,
        "replicas": replicas,
        "mixed_precision": runner.spec.mixed_precision,
        "jit_compile": bool(jit),
        "flops_per_example": flops,
        "train_flops_per_example": 3 * flops,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "fraction_of_peak": (achieved / peak) if peak else None,
        "error": error,
        **runner.extra,
    }


def _rate(rows, name) -> float | None:
    for row in rows:
        if row["runner"] == name and not row["error"] and row["examples_per_second"] > 0:
            return row["examples_per_second"]
    return None


def compute_ratios(rows: list[dict]) -> dict[str, float | None]:
    """engine/fit, engine/raw and (when a tfdata runner ran) engine/tfdata
    between the plain runners; each engine variant against the raw loop of
    its precision and XLA setting (`engine_bf16/raw_bf16`, `engine_stream/raw`);
    and the best engine variant against the best float32 peer (fit, raw or
    tfdata) when variants ran."""
    engine, fit, raw, tfdata = (_rate(rows, name) for name in RUNNER_KINDS)
    ratios: dict[str, float | None] = {
        "engine/fit": engine / fit if engine and fit else None,
        "engine/raw": engine / raw if engine and raw else None,
    }
    if any(row["runner"] == "tfdata" for row in rows):
        ratios["engine/tfdata"] = engine / tfdata if engine and tfdata else None
    good = [r for r in rows if not r["error"] and r["examples_per_second"] > 0]
    for row in good:  # Each engine variant against the raw loop of the same precision and XLA setting.
        if row["kind"] == "engine" and row["runner"] != "engine":
            raw_name = "raw" + row["runner"][len("engine") :].replace("_stream", "")
            raw_rate = _rate(rows, raw_name)
            if raw_rate:
                ratios[f"{row['runner']}/{raw_name}"] = row["examples_per_second"] / raw_rate
    engines = [r for r in good if r["kind"] == "engine"]
    peers = [r for r in good if r["kind"] != "engine" and r["mixed_precision"] == "float32"]
    if len(engines) > 1 or any(r["mixed_precision"] != "float32" or r["jit_compile"] for r in engines):
        if engines and peers:
            best = max(engines, key=lambda r: r["examples_per_second"])
            peer = max(peers, key=lambda r: r["examples_per_second"])
            ratios["best_engine/best_float32_peer"] = best["examples_per_second"] / peer["examples_per_second"]
            ratios["best_engine"] = best["runner"]
            ratios["best_float32_peer"] = peer["runner"]
    return ratios


def format_table(payload: dict) -> str:
    rows = payload["results"]
    header = ("runner", "mp", "jit", "ex/s median", "min", "max", "TFLOP/s", "% peak", "notes")
    lines = []
    for row in rows:
        notes = []
        if "steps_per_execution" in row:
            notes.append(f"spe={row['steps_per_execution']}")
        if row.get("fallback_error"):
            notes.append("fallback: " + row["fallback_error"][:90])
        if row["error"]:
            notes.append("ERROR: " + row["error"][:140])
        fraction = row.get("fraction_of_peak")
        lines.append(
            (
                row["runner"],
                row["mixed_precision"],
                "y" if row["jit_compile"] else "n",
                f"{row['examples_per_second']:,.1f}",
                f"{row['min']:,.1f}",
                f"{row['max']:,.1f}",
                f"{row['achieved_tflops']:.4f}",
                f"{100 * fraction:.1f}" if fraction is not None else "-",
                "; ".join(notes),
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    first = rows[0] if rows else {}
    out = [
        f"model={first.get('model')} strategy={first.get('strategy')} replicas={first.get('replicas')} "
        f"global_batch={first.get('global_batch_size')} "
        f"flops/example(fwd)={first.get('flops_per_example', 0):,} "
        f"peak TFLOP/s=" + ", ".join(f"{k} {v:.3f}" for k, v in payload.get("peak_tflops_by_dtype", {}).items()),
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip() for line in lines]
    data = payload.get("data") or {}
    if data.get("mode") == "tfrecord":
        out.insert(
            1,
            f"data=tfrecord: {data['records']:,} PNG records in {data['files']} files in {data['directory']}"
            + (" (reused)" if not data["written"] else ""),
        )
    ratio_text = []
    for key, value in payload["ratios"].items():
        if isinstance(value, float):
            ratio_text.append(f"{key}={value:.3f}")
        else:
            ratio_text.append(f"{key}={value}")
    out.append("ratios: " + "  ".join(ratio_text))
    return "\n".join(out)


def _log(message: str) -> None:
    print(f"[throughput] {message}", file=sys.stderr, flush=True)


def config_from_flags() -> BenchConfig:
    values = {setting.name: FLAGS[setting.name].value for setting in dataclasses.fields(BenchConfig)}
    return BenchConfig(**{**values, "runners": tuple(values["runners"])})


def main(argv) -> None:
    del argv
    config = config_from_flags()
    try:
        check_config(config)  # Fail on a typo before minutes of set-up.
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    import_tensorflow_lean()
    if config.cpu_devices > 1:
        # Before anything touches a TF device: logical CPUs cannot be added later.
        from engine import configure_cpu_devices

        configure_cpu_devices(config.cpu_devices)
    payload = run_benchmark(config)
    print(format_table(payload), flush=True)
    if FLAGS.json:
        directory = os.path.dirname(os.path.abspath(FLAGS.json))
        os.makedirs(directory, exist_ok=True)
        with open(FLAGS.json, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=False)


if __name__ == "__main__":
    define_flags()
    app.run(main)
