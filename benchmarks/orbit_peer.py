r"""The engine CLI's training run, written the way a TF Model Garden user writes it with Orbit.

    python -m benchmarks.orbit_peer --strategy=default --train_steps=2000

The peer `benchmarks.cli_vs_orbit` compares `python -m engine.main` with: an
`orbit.StandardTrainer` (compiled loop: `use_tf_function`,
`use_tf_while_loop`) driven by `orbit.Controller` with the same
`steps_per_loop`, checkpoint cadence and TensorBoard summaries; the models
registry's model at its default input shape, 10 classes; Adam (lr 1e-3)
built in the strategy's scope; the `input` package's synthetic source, its
global batches distributed with `strategy.experimental_distribute_dataset`;
per-example sparse cross-entropy from logits reduced with
`tf.nn.compute_average_loss`; a loss mean and a SparseCategoricalAccuracy
train metric; the same seed.

It prints one JSON line. `examples_per_second` is measured as the engine
measures its own (metrics.json): the summed time of every `trainer.train`
call (one compiled loop, its metrics read back) but the first, which holds
tracing; `loop_examples_per_second` lists those loops' own rates.
`wall_examples_per_second` is Orbit's own view (its StepTimer):
time between the ends of the loops, the Controller's summaries, log lines
and checkpoints included.

Orbit ships in the `tf-models-official` wheel and imports `tf_keras`; both
install without their dependencies (which would replace TensorFlow):
`pip install --no-deps tf-models-official==2.20.0 tf-keras==2.21.0`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks.cli_vs_orbit import ORBIT_MISSING  # noqa: E402  (no TensorFlow there)

try:
    import orbit
except ImportError as missing:  # The trainer below subclasses Orbit's: nothing runs without it.
    sys.exit(f"{ORBIT_MISSING} ({missing})")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from engine.strategy import build_strategy, configure_cpu_devices  # noqa: E402
from input import get_data_source  # noqa: E402
from models import get_model_spec  # noqa: E402

LEARNING_RATE = 1e-3
NUM_CLASSES = 10

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a script, so that importing the module defines none."""
    flags.DEFINE_enum("strategy", "default", ["default", "mirrored"], "The tf.distribute strategy.")
    flags.DEFINE_integer("cpu_devices", 1, "Logical CPU devices (replicas of --strategy=mirrored).")
    flags.DEFINE_string("model", "cnn", "Model name from the models registry.")
    flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all replicas.")
    flags.DEFINE_integer("steps_per_loop", 50, "Steps per compiled loop (orbit.Controller steps_per_loop).")
    flags.DEFINE_integer("train_steps", 2000, "Global steps to train.")
    flags.DEFINE_integer("checkpoint_every", 500, "Checkpoint interval in steps (the engine CLI's default).")
    flags.DEFINE_integer("max_checkpoints", 3, "Checkpoints to keep (the engine CLI's default).")
    flags.DEFINE_integer("seed", 42, "Seed of the weights and of the data stream.")
    flags.DEFINE_string(
        "model_dir", None, "Checkpoints and summaries (default: a temporary directory, removed)."
    )


class ClassifierTrainer(orbit.StandardTrainer):
    """Orbit's single-task recipe (orbit/examples/single_task) for Keras 3:
    a compiled `tf.while_loop` over `strategy.run(train_fn, next(iterator))`."""

    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        train_dataset: tf.distribute.DistributedDataset,
        global_batch_size: int,
        global_step: tf.Variable,
    ):
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.global_step = global_step
        with strategy.scope():
            self.train_loss = keras.metrics.Mean("loss")
            self.accuracy = keras.metrics.SparseCategoricalAccuracy("accuracy")
        self.loop_seconds: list[tuple[int, float]] = []  # (steps, seconds) of every train() call
        options = orbit.StandardTrainerOptions(use_tf_function=True, use_tf_while_loop=True)
        super().__init__(train_dataset, options=options)

    def train_loop_begin(self) -> None:
        self.train_loss.reset_state()
        self.accuracy.reset_state()

    def train_step(self, iterator) -> None:
        def train_fn(inputs):
            images, labels = inputs
            with tf.GradientTape() as tape:
                logits = self.model(images, training=True)
                per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch_size)
            variables = self.model.trainable_variables
            self.optimizer.apply(tape.gradient(loss, variables), variables)
            self.train_loss.update_state(tf.reduce_mean(per_example))
            self.accuracy.update_state(labels, logits)

        self.strategy.run(train_fn, args=(next(iterator),))
        self.global_step.assign_add(1)

    def train_loop_end(self) -> dict[str, tf.Tensor]:
        return {"loss": self.train_loss.result(), "accuracy": self.accuracy.result()}

    def train(self, num_steps: tf.Tensor):
        """Orbit's `train`, timed as the engine times a loop: the compiled call and
        the read-back of its results. (The measurement; not part of the recipe.)"""
        began = time.perf_counter()
        output = tf.nest.map_structure(orbit.utils.get_value, super().train(num_steps))
        self.loop_seconds.append((int(num_steps), time.perf_counter() - began))
        return output


class LoopEnds:
    """A train action: when each loop's Controller work began (Orbit's StepTimer view)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, output) -> None:
        self.times.append(time.perf_counter())


def steady_rate(loop_seconds: list[tuple[int, float]], global_batch_size: int) -> float | None:
    """Examples/s over every loop but the first (tracing); the first alone when it is the only one."""
    timed = loop_seconds[1:] or loop_seconds
    seconds = sum(s for _, s in timed)
    return sum(n for n, _ in timed) * global_batch_size / seconds if seconds > 0 else None


def run(model_dir: str) -> dict:
    if FLAGS.cpu_devices > 1:
        configure_cpu_devices(FLAGS.cpu_devices)
    keras.utils.set_random_seed(FLAGS.seed)
    strategy = build_strategy(FLAGS.strategy, cpu_devices=FLAGS.cpu_devices)
    spec = get_model_spec(FLAGS.model)
    height, width, channels = spec.default_input_shape  # Image models; the synthetic source makes images.
    source = get_data_source("synthetic", image_shape=(height, width, channels), num_classes=NUM_CLASSES)
    batch = FLAGS.global_batch_size
    with strategy.scope():
        model = spec.build(spec.default_input_shape, NUM_CLASSES)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(model.trainable_variables)  # Keras 3: slots before the first trace (NOTES.md).
        global_step = orbit.utils.create_global_step()
    dataset = strategy.experimental_distribute_dataset(
        source.train_dataset(global_batch_size=batch, seed=FLAGS.seed)
    )
    trainer = ClassifierTrainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_dataset=dataset,
        global_batch_size=batch,
        global_step=global_step,
    )
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, global_step=global_step)
    manager = tf.train.CheckpointManager(
        checkpoint,
        os.path.join(model_dir, "checkpoints"),
        max_to_keep=FLAGS.max_checkpoints,
        step_counter=global_step,
        checkpoint_interval=FLAGS.checkpoint_every,
    )
    loop_ends = LoopEnds()
    controller = orbit.Controller(
        global_step=global_step,
        trainer=trainer,
        strategy=strategy,
        train_actions=[loop_ends],
        steps_per_loop=FLAGS.steps_per_loop,
        checkpoint_manager=manager,
        summary_dir=os.path.join(model_dir, "train"),
    )
    controller.train(steps=FLAGS.train_steps)
    wall = loop_ends.times
    wall_steps = sum(n for n, _ in trainer.loop_seconds[1:])
    final = trainer.train_loop_end()
    return {
        "runner": "orbit",
        "model": FLAGS.model,
        "strategy": FLAGS.strategy,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch_size": batch,
        "steps_per_loop": FLAGS.steps_per_loop,
        "global_step": int(global_step.numpy()),
        "loops": len(trainer.loop_seconds),
        "examples_per_second": steady_rate(trainer.loop_seconds, batch),
        "loop_examples_per_second": [n * batch / s for n, s in trainer.loop_seconds[1:]],
        "wall_examples_per_second": (
            wall_steps * batch / (wall[-1] - wall[0]) if len(wall) > 1 and wall[-1] > wall[0] else None
        ),
        "loss": float(final["loss"]),
        "accuracy": float(final["accuracy"]),
    }


def main(argv: list[str]) -> None:
    del argv
    model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix="orbit-peer-")
    try:
        result = run(model_dir)
    finally:
        if FLAGS.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
