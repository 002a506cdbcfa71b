r"""Checkpoint cost: how long the step loop is blocked per save, synchronous against
asynchronous (`--async_checkpoint`), and the end-to-end slowdown of frequent saves.

    python -m benchmarks.checkpoint --model=resnet50 --json=benchmarks/out/checkpoint.json

One process, one model and Adam, one compiled training loop (`engine.Trainer` on the
synthetic data, no eval), two `engine.checkpointing.checkpointer.Checkpointer`s on the same variables
(one synchronous, one asynchronous), each in its own directory of `--model_dir`:

- blocking: `--saves` saves of each kind, interleaved (sync, async, sync, ...), with
  `--steps_between_saves` training steps before each; a save's blocking time is the
  wall time of `save()`, the time the loop cannot train. The asynchronous write is
  waited for (untimed, reported as `async_wait_s`) before the next synchronous save, so
  that it never competes with one being timed. Medians are reported.
- end to end: `trainer.train` over `--steps` steps with no checkpoints, with a save every
  `--checkpoint_every` steps synchronously, and asynchronously (the end of `train` waits
  for the last write), interleaved `--repeats` times; the slowdown is a median run's time
  over the median run without saves, minus 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
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

from engine.lean_imports import import_tensorflow_lean  # noqa: E402

FLAGS = flags.FLAGS
LEARNING_RATE = 1e-3
MODES = ("none", "sync", "async")  # End to end: no saves, then each kind.


def _option(default: Any, help_text: str) -> Any:
    """A BenchConfig field and its flag (`define_flags`): the default and help, in one place."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class BenchConfig:
    model: str = _option("resnet50", "Model name from the models registry (resnet50, cnn, mlp, ...).")
    global_batch_size: int = _option(8, "Global batch size.")
    steps_per_loop: int = _option(2, "Steps per compiled call.")
    warmup_steps: int = _option(2, "Untimed steps first (tracing, compiling).")
    saves: int = _option(5, "Timed saves of each kind (sync, async) for the blocking figures.")
    steps_between_saves: int = _option(2, "Training steps before each timed save.")
    steps: int = _option(8, "Steps of each end-to-end run.")
    checkpoint_every: int = _option(2, "End to end: a save every N steps (frequent).")
    repeats: int = _option(2, "End-to-end runs of each kind, interleaved.")
    num_classes: int = _option(10, "Classes of the synthetic data.")
    seed: int = _option(42, "Seed of the model and the data stream.")
    model_dir: str = _option("", "Where the checkpoints go (default: a temporary directory, removed).")


def define_flags() -> None:
    """The flags, one per `BenchConfig` field; defined only when run as a script."""
    for setting in dataclasses.fields(BenchConfig):
        help_text, default = setting.metadata["help"], setting.default
        if isinstance(default, int):
            flags.DEFINE_integer(setting.name, default, help_text)
        else:
            flags.DEFINE_string(setting.name, default, help_text)
    flags.DEFINE_string("json", None, "Write the results as JSON to this path.")


def check_config(config: BenchConfig) -> None:
    """Fail on an impossible setting before minutes of set-up."""
    for name in ("global_batch_size", "steps_per_loop", "saves", "steps_between_saves", "steps", "repeats"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name}={getattr(config, name)} must be at least 1")
    if config.checkpoint_every < 1 or config.steps % config.checkpoint_every:
        raise ValueError(
            f"--checkpoint_every={config.checkpoint_every} must divide --steps={config.steps}, "
            "so that every end-to-end run saves as often"
        )


@contextlib.contextmanager
def _directory(path: str) -> Iterator[str]:
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
        return
    temporary = tempfile.mkdtemp(prefix="checkpoint-bench-")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Measures `config`; returns the JSON payload."""
    check_config(config)
    with _directory(config.model_dir) as directory:
        return _measure(config, directory)


def _build_trainer(config: BenchConfig):
    import keras
    import tensorflow as tf

    from engine import Cadence, Trainer
    from engine.cli.process.environment import seed_everything
    from input import get_data_source
    from models import get_model_spec

    seed_everything(config.seed)
    spec = get_model_spec(config.model)
    source = get_data_source("synthetic", image_shape=spec.default_input_shape, num_classes=config.num_classes)
    strategy = tf.distribute.get_strategy()
    with strategy.scope():
        model = spec.build(spec.default_input_shape, config.num_classes)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)

    def train_data(start_step):
        return source.train_dataset(
            global_batch_size=config.global_batch_size, seed=config.seed, start_step=start_step
        )

    return Trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        global_batch_size=config.global_batch_size,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        cadence=Cadence(steps_per_loop=config.steps_per_loop),
    )


def _checkpointer(trainer, directory: str, *, background: bool):
    """A Checkpointer of the trainer's model, step and optimizer, as the Trainer makes its own."""
    import tensorflow as tf

    from engine.checkpointing.checkpointer import Checkpointer
    from engine.options import CheckpointOptions

    return Checkpointer(
        directory,
        tf.train.Checkpoint(model=trainer.model, global_step=trainer.global_step, optimizer=trainer.optimizer),
        model=trainer.model,
        step_counter=trainer.global_step,
        options=CheckpointOptions(max_checkpoints=2, async_checkpoint=background),
    )


def _measure(config: BenchConfig, directory: str) -> dict[str, Any]:
    from engine.options import Cadence

    trainer = _build_trainer(config)
    checkpointers = {
        "sync": _checkpointer(trainer, os.path.join(directory, "sync"), background=False),
        "async": _checkpointer(trainer, os.path.join(directory, "async"), background=True),
    }
    _log(f"{config.model}: {_parameters(trainer.model):,} parameters; warming up")
    trainer.train(trainer.step + config.warmup_steps)

    blocking: dict[str, list[float]] = {"sync": [], "async": []}
    waits: list[float] = []
    for index in range(config.saves):
        for mode, checkpointer in checkpointers.items():
            trainer.train(trainer.step + config.steps_between_saves)
            began = time.perf_counter()
            checkpointer.save(trainer.step)
            blocking[mode].append(time.perf_counter() - began)
            if mode == "async":
                trainer.train(trainer.step + config.steps_between_saves)  # The write runs beside these.
                began = time.perf_counter()
                checkpointer.wait()
                waits.append(time.perf_counter() - began)
        _log(
            f"save {index + 1}/{config.saves}: sync {blocking['sync'][-1]:.3f} s, "
            f"async {blocking['async'][-1]:.3f} s"
        )

    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    every = Cadence(steps_per_loop=config.steps_per_loop, checkpoint_every=config.checkpoint_every)
    plain = Cadence(steps_per_loop=config.steps_per_loop)
    for repeat in range(config.repeats):
        for mode in MODES:
            trainer.checkpointer = checkpointers.get(mode)
            trainer.options = dataclasses.replace(trainer.options, cadence=plain if mode == "none" else every)
            began = time.perf_counter()
            trainer.train(trainer.step + config.steps)
            runs[mode].append(time.perf_counter() - began)
        _log(f"run {repeat + 1}/{config.repeats}: " + ", ".join(f"{m} {runs[m][-1]:.2f} s" for m in MODES))
    trainer.checkpointer = None
    for checkpointer in checkpointers.values():
        checkpointer.wait()

    sync_blocking = statistics.median(blocking["sync"])
    async_blocking = statistics.median(blocking["async"])
    base = statistics.median(runs["none"])
    return {
        "config": dataclasses.asdict(config),
        "parameters": _parameters(trainer.model),
        "checkpoint_bytes": _checkpoint_bytes(os.path.join(directory, "sync", "checkpoints")),
        "sync_blocking_s": sync_blocking,
        "async_blocking_s": async_blocking,
        "blocking_ratio": async_blocking / sync_blocking,
        "async_wait_s": statistics.median(waits),
        "blocking_s": blocking,
        "run_s": runs,
        "sync_slowdown": statistics.median(runs["sync"]) / base - 1,
        "async_slowdown": statistics.median(runs["async"]) / base - 1,
        "machine": _machine(),
    }


def _parameters(model) -> int:
    return int(sum(int(w.numpy().size) for w in model.weights))


def _checkpoint_bytes(directory: str) -> int:
    """The size of the newest checkpoint's files."""
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(directory)
    if latest is None:
        return 0
    prefix = os.path.basename(latest) + "."
    return sum(
        os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.startswith(prefix)
    )


def _machine() -> dict[str, Any]:
    import platform

    import keras
    import tensorflow as tf

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def format_table(payload: dict) -> str:
    return "\n".join(
        [
            f"model={payload['config']['model']}  parameters={payload['parameters']:,}  "
            f"checkpoint={payload['checkpoint_bytes'] / 2**20:.1f} MiB",
            f"blocking per save (median of {payload['config']['saves']}): "
            f"sync {payload['sync_blocking_s']:.3f} s  "
            f"async {payload['async_blocking_s']:.3f} s  ratio {payload['blocking_ratio']:.3f}  "
            f"(async write left after {payload['config']['steps_between_saves']} steps: "
            f"{payload['async_wait_s']:.3f} s)",
            f"end to end, a save every {payload['config']['checkpoint_every']} steps: "
            f"sync {payload['sync_slowdown']:+.1%}  async {payload['async_slowdown']:+.1%} "
            f"(no saves: {statistics.median(payload['run_s']['none']):.2f} s "
            f"per {payload['config']['steps']} steps)",
        ]
    )


def _log(message: str) -> None:
    print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def config_from_flags() -> BenchConfig:
    return BenchConfig(
        **{setting.name: FLAGS[setting.name].value for setting in dataclasses.fields(BenchConfig)}
    )


def main(argv) -> None:
    del argv
    config = config_from_flags()
    try:
        check_config(config)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    import_tensorflow_lean()
    payload = run_benchmark(config)
    print(format_table(payload), flush=True)
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
