"""The parts of a run built from its settings, shared by the training job and the evaluator.

Both must build the same process state (devices, precision, seeds), task
(data, model, loss), optimizer from the same flags: the evaluator restores
what the trainer saved, so one definition keeps them from drifting apart.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from absl import logging

from engine.checkpointing.checkpointer import CheckpointReader, checkpoint_of, recorded_settings
from engine.cli.config.settings import RunConfig
from engine.cli.config.settings.sections import (
    DeviceSettings,
    NumericSettings,
    OptimizationSettings,
    StateSettings,
)
from engine.cli.process.environment import seed_everything, set_precision
from engine.cli.run.run_task import RunTask, resolve_task
from engine.ema import averages_swapped_in, weight_averages
from engine.precision import with_loss_scaling
from engine.schedules import LearningRate, learning_rate_schedule
from engine.strategy import build_strategy, configure_cpu_devices
from engine.trainer.checks import prepare_model_state


def prepare_process(devices: DeviceSettings, numerics: NumericSettings) -> None:
    """Process-wide settings, before any model or strategy exists: logical CPU
    devices, the Keras dtype policy, seeds (and op determinism)."""
    # tf.distribute logs every cross-device reduction at INFO; keep the engine's lines readable.
    tf.get_logger().setLevel("WARNING")
    if devices.cpu_devices > 1:
        configure_cpu_devices(devices.cpu_devices)
    set_precision(numerics.mixed_precision)
    seed_everything(numerics.seed, deterministic=numerics.deterministic)


def build_model_and_optimizer(
    optimization: OptimizationSettings, strategy: tf.distribute.Strategy, task: RunTask, total_steps: int
) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """The task's model (checked against the data before anything is written) and its optimizer,
    created in `strategy`'s scope; the learning-rate schedule spans `total_steps`."""
    with strategy.scope():
        model = task.build_model()
        learning_rate = learning_rate_schedule(
            optimization.lr_schedule, optimization.learning_rate, total_steps, optimization.warmup_steps
        )
        optimizer = build_optimizer(optimization.optimizer, learning_rate, model)
    return model, optimizer


def build_optimizer(name: str, learning_rate: LearningRate, model: keras.Model) -> keras.optimizers.Optimizer:
    """The `--optimizer` named `name`; under `--mixed_precision=float16` (the model's mixed_float16
    policy) wrapped in a dynamic loss scale, as the Trainer and Keras `compile()` wrap it."""
    optimizers = {
        "sgd": lambda: keras.optimizers.SGD(learning_rate),
        "momentum": lambda: keras.optimizers.SGD(learning_rate, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(learning_rate),
        "adamw": lambda: keras.optimizers.AdamW(learning_rate),
    }
    return with_loss_scaling(optimizers[name](), model)


class CheckpointedModel:
    """The training's model, optimizer and global step, rebuilt from the settings to read its
    checkpoints read-only (`CheckpointReader`): what `--mode=eval`, `continuous_eval` and
    `predict` restore into. Built on this host alone, whatever the training's cluster."""

    def __init__(self, config: RunConfig, *, model_dir: str, source=None):
        """`source`: an input.DescribedSource of the training's examples (predict), so that no
        data is read; None reads the data the settings name (eval needs its examples)."""
        prepare_process(config.devices, config.numerics)
        # The cluster's strategy needs its peers; a reader works alone on this host.
        local = "mirrored" if config.cpu_devices > 1 or config.num_gpus else "default"
        name = config.strategy if config.strategy in ("default", "one_device", "mirrored") else local
        self.strategy = build_strategy(name, cpu_devices=config.cpu_devices, num_gpus=config.num_gpus)
        self.task = resolve_task(config.problem, source=source)
        self.source = self.task.source
        self.final_step = config.total_steps(self.source.num_train_examples)
        # As training builds them (checked against the data before anything is read or written).
        self.model, self.optimizer = build_model_and_optimizer(
            config.optimization, self.strategy, self.task, self.final_step
        )
        # As the Trainer prepares them: the averages (--ema_decay) exist once the optimizer is built.
        self.weight_averages = weight_averages(
            {"optimizer": self.optimizer}, trained_ema_decay(config.state, model_dir)
        )
        self.global_step = prepare_model_state(self.strategy, self.model, {"optimizer": self.optimizer})
        self.reader = CheckpointReader(
            checkpoint_of(self.model, self.global_step, {"optimizer": self.optimizer})
        )

    @property
    def step(self) -> int:
        return int(self.global_step.numpy())

    def averaged_weights(self) -> contextlib.AbstractContextManager:
        """The moving averages swapped in (the model the checkpoints were judged by), if any."""
        return averages_swapped_in(self.weight_averages)


def trained_ema_decay(state: StateSettings, model_dir: str) -> float | None:
    """The --ema_decay the checkpoints were trained with (their averages are what is
    evaluated or predicted with), else this command's."""
    recorded = recorded_settings(model_dir).get("ema_decay")
    decay = float(recorded) if recorded is not None else state.ema_decay
    if decay != state.ema_decay:
        logging.info("using --ema_decay=%s, as the checkpoints were trained", decay)
    return decay or None
