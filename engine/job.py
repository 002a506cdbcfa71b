"""A whole training job from a `RunConfig`: what `engine.main` runs.

Separate from `main.py` so tests and benchmarks can run a job in-process
without absl flag parsing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from engine.cluster import task_model_dir
from engine.config import RunConfig
from engine.environment import seed_everything, set_precision
from engine.errors import UserError
from engine.export import export_saved_model
from engine.hooks.from_config import hooks_from_config
from engine.hparams import write_hparams
from engine.preemption import stop_on_signals
from engine.schedules import LearningRate, learning_rate_schedule
from engine.strategy import build_strategy, configure_cpu_devices
from engine.trainer import Trainer

METRICS_FILE = "metrics.json"
# A worker that stopped because a peer was signalled (EX_TEMPFAIL: run again).
STOPPED_BY_PEER_EXIT = 75


def build_optimizer(name: str, learning_rate: LearningRate, mixed_precision: str) -> keras.optimizers.Optimizer:
    optimizers = {
        "sgd": lambda: keras.optimizers.SGD(learning_rate),
        "momentum": lambda: keras.optimizers.SGD(learning_rate, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(learning_rate),
        "adamw": lambda: keras.optimizers.AdamW(learning_rate),
    }
    optimizer = optimizers[name]()
    if mixed_precision == "float16":
        # float16 gradients underflow without a (dynamic) loss scale.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def run(config: RunConfig) -> dict[str, Any]:
    """Trains and evaluates as `config` says; returns what metrics.json holds.

    A run stopped by SIGTERM/SIGINT saves a checkpoint, skips the final
    evaluation and metrics.json, and returns its `exit_status` (128+signal;
    75 on the other workers of a multi-worker run, which stop with it).
    """
    from engine import evaluator
    from input import DataError, get_data_source
    from models import get_model_spec

    evaluation_mode = evaluator.evaluation_mode(config)
    if evaluation_mode is not None:  # --mode=eval/continuous_eval or an evaluator task: never trains.
        return evaluator.run(config, evaluation_mode)
    # tf.distribute logs every cross-device reduction at INFO; keep the engine's lines readable.
    tf.get_logger().setLevel("WARNING")
    if config.cpu_devices > 1:
        configure_cpu_devices(config.cpu_devices)
    set_precision(config.mixed_precision)
    if config.check_numerics:
        tf.debugging.enable_check_numerics()  # Names the first op that makes a NaN or Inf.
    seed_everything(config.seed, deterministic=config.deterministic)
    multi_host = config.multi_host_options()
    strategy = build_strategy(config.strategy, cpu_devices=config.cpu_devices,
                              num_gpus=config.num_gpus, multi_host=multi_host)
    cluster = multi_host.cluster
    if config.jit_compile and not tf.config.list_logical_devices("GPU"):
        logging.warning("--jit_compile on a host without GPUs: XLA's CPU kernels ran the cnn "
                        "5-7x slower than TensorFlow's oneDNN kernels here (benchmarks/RESULTS.md)")
    model_spec = get_model_spec(config.model)
    image_shape = model_spec.default_input_shape
    try:
        source = get_data_source(config.dataset, image_shape=image_shape, data_dir=config.data_dir)
    except DataError as error:
        raise UserError(str(error)) from None
    model_dir = config.model_dir or tempfile.mkdtemp(prefix="engine-")
    # Only the chief writes model_dir; other workers write a private copy they remove.
    write_dir = task_model_dir(model_dir, cluster)
    total_steps = config.total_steps(source.num_train_examples)

    with strategy.scope():
        model = model_spec.build(image_shape, source.num_classes)
        learning_rate = learning_rate_schedule(config.lr_schedule, config.learning_rate,
                                               total_steps, config.warmup_steps)
        optimizer = build_optimizer(config.optimizer, learning_rate, config.mixed_precision)

    batch, seed = config.global_batch_size, config.seed
    if config.input_pipeline == "global":
        def train_data(start_step):
            return source.train_dataset(global_batch_size=batch, seed=seed, start_step=start_step)
        eval_data = source.eval_dataset(global_batch_size=batch)
    else:
        def train_data(input_context, start_step):
            return source.train_dataset(global_batch_size=batch, seed=seed,
                                        start_step=start_step, input_context=input_context)
        eval_data = None
        if source.num_eval_examples is not None:
            def eval_data(input_context):
                return source.eval_dataset(global_batch_size=batch, input_context=input_context)

    if config.mode == "train":
        eval_data = None
    if write_dir != model_dir:  # A restarted worker's scratch from the run it died in.
        shutil.rmtree(write_dir, ignore_errors=True)
    trainer_class = Trainer
    if config.strategy == "parameter_server":
        from engine.coordinator import CoordinatedTrainer as trainer_class
    trainer = trainer_class(
        strategy=strategy, model=model, optimizer=optimizer,
        train_data=train_data, eval_data=eval_data, global_batch_size=batch,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        model_dir=write_dir, restore_dir=model_dir if write_dir != model_dir else None,
        steps_per_loop=config.steps_per_loop,
        eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
        max_checkpoints=config.max_checkpoints, clip_norm=config.clip_norm,
        grad_accum_steps=config.grad_accum_steps, jit_compile=config.jit_compile,
        on_nonfinite=config.on_nonfinite, restore_fallback=config.restore_fallback,
        callbacks=hooks_from_config(config), log_every=config.log_every,
    )
    _log_banner(config, strategy, model, source, model_dir, total_steps, trainer.step)
    if strategy.extended.should_checkpoint:
        write_hparams(model_dir, dataclasses.asdict(config))
    try:
        with stop_on_signals(trainer) as signal_record:
            train_logs = trainer.train(total_steps)
        if trainer.stop_requested:
            trainer.close()
            cause = (f"signal {signal_record.signum}" if signal_record.signum is not None
                     else "a stop request from another worker")
            logging.warning("stopped at step %d by %s; checkpoint saved in %s; rerun the same "
                            "command to continue", trainer.step, cause, model_dir)
            return {"global_step": trainer.step,
                    "exit_status": signal_record.exit_status or STOPPED_BY_PEER_EXIT}
        eval_logs = trainer.evaluate_current() if eval_data is not None else {}
        trainer.close()
    finally:
        if write_dir != model_dir:
            shutil.rmtree(write_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # The shared parent, once the last worker is done.
                os.rmdir(os.path.dirname(write_dir))
    if config.export_dir and strategy.extended.should_checkpoint:  # Only the chief exports.
        export_saved_model(model, config.export_dir, [tf.TensorSpec([None, *image_shape], tf.float32)])
    speed = trainer.steady_examples_per_second or train_logs.get("examples_per_second")
    result = {
        "global_step": trainer.step,
        "train": train_logs,
        "eval": eval_logs,
        "examples_per_second": speed,
        "model_dir": model_dir,
    }
    if write_dir == model_dir:
        _write_json(os.path.join(model_dir, METRICS_FILE), result)
    logging.info("done: step %d, eval %s, %.0f examples/s; wrote %s%s",
                 trainer.step, eval_logs, speed or 0.0,
                 os.path.join(model_dir, METRICS_FILE) if write_dir == model_dir else "nothing (not the chief)",
                 "" if cluster is None else f"; weights_digest={_weights_digest(model)}")
    return result


def _weights_digest(model) -> str:
    """A fingerprint of the weights: equal on every worker of a synchronous run."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()[:16]


def _log_banner(config, strategy, model, source, model_dir, total_steps, start_step) -> None:
    replicas = strategy.num_replicas_in_sync
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # The default strategy has no device list.
        devices = ("default device",)
    logging.info(
        "strategy=%s replicas=%d devices=%s global_batch=%d per_replica_batch=%d "
        "model=%s params=%d dataset=%s (%s train / %s eval) steps=%d->%d model_dir=%s",
        config.strategy, replicas, ",".join(devices), config.global_batch_size,
        config.global_batch_size // replicas, config.model, model.count_params(),
        config.dataset, source.num_train_examples, source.num_eval_examples,
        start_step, total_steps, model_dir,
    )


def _write_json(path: str, payload: dict) -> None:
    """Writes atomically, so a reader never sees half a file."""
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
    os.replace(temporary, path)
