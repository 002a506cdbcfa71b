"""`RunConfig`: the validated settings of one run of `engine.main`. This module imports no
TensorFlow (flag parsing and `--help` stay fast); `validate` imports the model and data packages."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import TYPE_CHECKING, Any

from engine.cli.config.settings.fields import (
    CLUSTER_SETTINGS,
    COMMUNICATIONS,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_DEVICE_DATA_MB,
    DEFAULT_EPOCHS,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_MIN_STEPS,
    DEFAULT_SLURM_PORT_BASE,
    DEFAULT_STARTUP_TIMEOUT,
    INPUT_PIPELINES,
    INT32_MAX,
    INT64_MAX,
    MAX_CPU_DEVICES,
    MAX_ROLLBACKS,
    MAX_TIMEOUT_SECONDS,
    METRIC_MODES,
    MODES,
    NONFINITE_POLICIES,
    OPTIMIZER_NAMES,
    OPTIONS_WITHOUT_SETTINGS,
    PRECISION_POLICIES,
    RESOLVERS,
    SCHEDULE_NAMES,
    STRATEGY_NAMES,
    TIMEOUTS,
    at_least,
    choice_message,
    choose,
    option_setting,
    setting,
    settings_of,
)
from engine.cli.config.settings.paths import check_model_dir, check_predict_paths
from engine.errors import UserError
from engine.options import (
    TRAINER_GROUPS,
    Cadence,
    CheckpointOptions,
    SpikeOptions,
    StepOptions,
    ThroughputOptions,
    options_from,
)


def trainer_options(config: RunConfig, **computed: Any) -> dict[str, Any]:
    """The Trainer's option groups as its keyword arguments (`{"step": StepOptions(...), ...}`),
    each option the setting of its name in `config` or, for those no setting
    holds (`OPTIONS_WITHOUT_SETTINGS`), its value in `computed` (else its default)."""
    not_computed = sorted(set(computed) - set(OPTIONS_WITHOUT_SETTINGS))
    assert not not_computed, f"{not_computed} come from the settings of their names"
    values = {**{field.name: getattr(config, field.name) for field in dataclasses.fields(RunConfig)}, **computed}
    return {keyword: options_from(group, values) for keyword, group in TRAINER_GROUPS.items()}


def flag_settings() -> tuple[str, ...]:
    """The names of the settings that are flags (every field but the config-file-only ones)."""
    return tuple(field.name for field in dataclasses.fields(RunConfig) if field.metadata["flag"])


if TYPE_CHECKING:
    from engine.cluster.multi_host import MultiHostOptions


@dataclasses.dataclass(frozen=True)
class RunConfig:
    # Strategy and cluster.
    strategy: str = setting(
        "default",
        "The tf.distribute strategy; multi_worker_mirrored, parameter_server and tpu span several machines.",
        choices=STRATEGY_NAMES,
    )
    cpu_devices: int = setting(
        1,
        "Logical CPU devices to split the host CPU into; `mirrored` uses them as replicas when there is no GPU.",
    )
    num_gpus: int | None = setting(None, "GPUs for mirrored/one_device (default: all visible).")
    communication: str = setting(
        "auto", "multi_worker_mirrored collectives: ring is gRPC, nccl needs GPUs.", choices=COMMUNICATIONS
    )
    collective_timeout: float = setting(
        DEFAULT_COLLECTIVE_TIMEOUT,
        "Seconds a multi-worker collective waits for its peers before the run "
        "fails (a dead worker becomes an error, not a hang); 0 waits forever.",
    )
    startup_timeout: float = setting(
        DEFAULT_STARTUP_TIMEOUT,
        "Seconds a cluster task waits to reach its peers at start-up before it "
        "exits with one line naming them; 0 waits forever.",
    )
    heartbeat_timeout: float = setting(
        DEFAULT_HEARTBEAT_TIMEOUT,
        "multi_worker_mirrored: seconds without a heartbeat after which a peer counts as lost; a frozen, "
        "partitioned or dead peer then ends the run (exit 69) within about this bound. parameter_server: "
        "the chief's bound on a ps task that stops answering (exit 69, the latest checkpoint kept).",
    )
    tpu: str | None = setting(
        None,
        "--strategy=tpu: `local` (TPU VM) or grpc://HOST:PORT; without a reachable TPU the run fails at once.",
    )
    # Several machines (engine.cluster): these are defined by engine.cli.config.cluster_flags.
    worker_hosts: list[str] | None = setting(
        None,
        "Comma-separated host:port of every worker task; the host flags build TF_CONFIG (an existing TF_CONFIG "
        "variable is used as is; do not set both).",
    )
    ps_hosts: list[str] | None = setting(None, "Comma-separated host:port of every parameter-server task.")
    chief_host: str | None = setting(None, "host:port of the chief (the parameter-server coordinator).")
    task_type: str | None = setting(  # A string: engine.cluster names a bad one with its source.
        None,
        "This process's task with the host flags: worker, ps, chief, or evaluator "
        "(runs continuous_eval, never trains; needs no host flags).",
    )
    task_index: int | None = setting(None, "This process's index within --task_type (default 0).")
    cluster_resolver: str = setting(
        "tf_config",
        "tf_config: the host flags or the TF_CONFIG variable; slurm: SLURM_* variables, every task of the srun "
        "step becomes a worker (multi_worker_mirrored), nodes sorted, ports from --slurm_port_base up.",
        choices=RESOLVERS,
    )
    slurm_port_base: int = setting(
        DEFAULT_SLURM_PORT_BASE, "With --cluster_resolver=slurm, a node's tasks listen on this port and up."
    )
    # What this process does (TF Model Garden's modes).
    print_config: bool = setting(
        False,
        "Print every setting as this command resolves it (defaults, <model_dir>/config.yaml, --config_file, "
        "--params_override, flags and --flagfile), checked, as YAML that --config_file reads back; then exit "
        "without training or writing anything.",
    )
    dry_run: bool = setting(
        False,
        "Check this config on this machine in seconds, as its cluster would run it: the replicas simulated "
        "as logical CPU devices (--dry_run_workers), the model built, one batch through one compiled step, "
        "the batch split, the memory per replica and the checkpoint's size; then exit. Each problem is one "
        "line, exit 2; nothing is written, no port opened.",
    )
    dry_run_workers: int = setting(
        0,
        "With --dry_run: the workers of the multi_worker_mirrored or parameter_server cluster to simulate; "
        "0: the cluster's (the cluster flags or TF_CONFIG). To start workers here: python -m engine.launch.",
    )
    dry_run_ps: int = setting(
        0, "With --dry_run --strategy=parameter_server --dry_run_workers=N: the ps tasks to simulate (0: one)."
    )
    config_file: tuple[str, ...] = setting(
        (),
        "A YAML or JSON file of settings, keys named as these flags (and task_params); repeat it for several, "
        "later files win. Precedence: defaults < <model_dir>/config.yaml < config files < --params_override "
        "< flags.",
    )
    params_override: str | None = setting(
        None,
        "NAME=VALUE,... over the config files, each value read as YAML (1e-3, true, [h:1,h:2]; quote a value "
        "with commas); dotted names reach into task_params (task_params.units=128). Flags still win.",
    )
    mode: str = setting(
        "train_and_eval",
        "train: no evaluation at all; eval: the latest checkpoint of --model_dir once (eval summaries at its "
        "step and metrics.json); train_and_eval; continuous_eval: each new checkpoint once, until the final "
        "step's.",
        choices=MODES,
    )
    eval_timeout: float = setting(
        3600.0, "continuous_eval: exit after this many seconds without a new checkpoint."
    )
    predict_input: str | None = setting(
        None,
        "--mode=predict: the examples, an .npz with an x array or a .csv of numbers (a header row, one "
        "example a row), each example the model's input shape or that many values; uint8 pixels are scaled "
        "by 1/255 as in training, floats taken as they are.",
    )
    predict_output: str | None = setting(
        None, "--mode=predict: where the model's outputs go, one row per example: a new .npy or .csv file."
    )
    # The problem: model, data, loss and metrics (strings, not enums: they also take package.module:function).
    task: str | None = setting(
        None,
        "package.module:function returning an engine.Task (model, data, loss, metrics, custom steps); what it "
        "leaves None comes from --model, --dataset, --loss and --metrics. Called with the config's task_params.",
    )
    model: str = setting(
        "cnn",
        "Model name (models/registry.py): cnn (Conv32-pool-Conv64-pool-Dense64-Dense), mlp (any input shape), "
        "resnet (a small ResNet), resnet50, wide_mlp, wide_deep (sharded id tables, for --dataset=clicks); or "
        "package.module:function: your "
        "function(input_shape, num_outputs) returning a keras.Model of logits (or values, for a regression), "
        "given the data's example shape and the size the labels need.",
    )
    dataset: str = setting(
        "digits",
        "digits (offline, real; the default), mnist (Keras cache or --data_dir), synthetic, tfrecord (image "
        "files in --data_dir, at their own size), clicks (synthetic click logs: numbers and hashed ids); "
        "PATH.npz (x_train, y_train, optionally x_test, y_test); "
        "PATH.csv (numeric columns, with --label_column); tfds:NAME[/CONFIG] (prepared in --data_dir); or "
        "package.module:function returning (train, eval) tf.data.Datasets of unbatched (features, labels) "
        "or an input.DataSource.",
    )
    data_dir: str | None = setting(
        None, "Where mnist.npz, the TFRecord files or the tensorflow-datasets sets are."
    )
    label_column: str | None = setting(
        None, "--dataset=PATH.csv: the column of labels; every other is a feature."
    )
    normalize: str = setting(
        "standardize",
        "--dataset=PATH.csv: standardize: the model standardizes each feature column by the training "
        "split's mean and standard deviation, and scales a regression's outputs to its labels' (layers "
        "inside the model, so evaluation, predict and the export apply them); none: the columns as they are.",
        choices=("standardize", "none"),
    )
    ps_shards: int = setting(
        4,
        "Row shards of each engine.ShardedEmbedding table the --model builds without a num_shards of its own "
        "(wide_deep's): a parameter_server cluster spreads them over its ps tasks. Part of the model: a "
        "model_dir with checkpoints keeps its count, which restores onto any number of ps tasks. At most a "
        "table's rows, and 1024 shard variables in all the tables (each adds a gather and an update to every "
        "step).",
    )
    eval_file: str | None = setting(None, "--dataset=PATH.csv: the eval split, a .csv with the same columns.")
    eval_fraction: float = setting(
        0.1,
        "A .csv without --eval_file or an .npz without x_test: this fraction of the examples is held out to "
        "evaluate (always the same ones, whatever --seed); 0: no evaluation.",
    )
    image_shape: str | None = setting(
        None,
        "H,W,C: serve images resized (bilinear) and converted (grey <-> RGB) to this shape: tfrecord files "
        "(default: the first record's own size and channels) and digits, mnist, synthetic (default: the "
        "model's input shape).",
    )
    num_classes: int | None = setting(
        None, "Classes of integer labels (default: the largest label + 1; tfrecord: of the eval files)."
    )
    loss: str | None = setting(
        None,
        "A Keras loss name: sparse_categorical_crossentropy, categorical_crossentropy, "
        "binary_crossentropy, binary_focal_crossentropy, mse, mae, huber, log_cosh, msle, mape (default: by "
        "the labels: integer class ids sparse_categorical_crossentropy, 0/1 label columns binary_crossentropy, "
        "floats mse). A regression loss reads integer labels as values.",
    )
    metrics: list[str] | None = setting(
        None,
        "Eval (and train) metrics besides the loss, comma-separated: accuracy, top_5_accuracy, auc, precision, "
        "recall, mae, mse, rmse, r2, or a keras.metrics name; they see probabilities for classification "
        "(default: accuracy; mae for values).",
    )
    task_params: dict[str, Any] = setting(
        {},
        "Keyword arguments for a task function, a mapping set only by --config_file (task_params: {...}) or "
        "--params_override (task_params.NAME=VALUE); no flag.",
        flag=False,
    )
    input_pipeline: str = setting(
        "per_replica",
        "per_replica: distribute_datasets_from_function, one sharded pipeline per worker yielding per-replica "
        "batches; global: experimental_distribute_dataset over global batches.",
        choices=INPUT_PIPELINES,
    )
    device_data_mb: int = setting(
        DEFAULT_DEVICE_DATA_MB,
        "An in-memory train split (digits, mnist, synthetic) up to this many MiB is copied to every "
        "replica's device and batches are gathered inside the compiled loop (same batches, no tf.data "
        "iterator; not under parameter_server or tpu), and its eval split beside it where both fit; "
        "larger splits, or 0, stream through --input_pipeline.",
    )
    # How long and how.
    global_batch_size: int = setting(
        64, "Examples per step over all replicas (must divide by replicas x --grad_accum_steps)."
    )
    train_steps: int | None = setting(None, "Global steps to train to (alternative to --epochs).")
    epochs: float | None = setting(
        None,
        f"Epochs to train (alternative to --train_steps; when neither is set, {DEFAULT_EPOCHS:g} epochs and at "
        f"least {DEFAULT_MIN_STEPS} steps).",
    )
    steps_per_loop: int = option_setting(
        Cadence,
        "steps_per_loop",
        "Steps per compiled call (the longest; loops are cut at evaluations, checkpoints, --log_every and "
        "--profile_steps).",
    )
    log_every: int = setting(
        0,
        "Progress line (step, loss, metrics, examples/sec, steps/sec, ETA) every N steps (loops are cut to "
        "match; steps_per_loop stays the longest); 0: one line per compiled loop. A progress bar too when "
        "stdout is a terminal.",
    )
    eval_every: int = setting(100, "Evaluate every N steps; 0 evaluates only at the end.")
    log_prefix: bool = setting(
        False,
        "Print absl's prefix before every log line (level letter, date, time, thread, file:line: `I1201 "
        "16:42:25.123456 140213 job.py:212] `), for tools that read the times; default: the message alone, "
        "warnings and errors marked `warning: ` / `error: `.",
    )
    log_all_tasks: bool = setting(
        False,
        "In a cluster, every task prints its progress and INFO lines, each line prefixed by the task "
        "(`[worker:1] `); default: only the chief (worker 0 of multi_worker_mirrored, the coordinator of "
        "parameter_server) and an evaluator task do, the others print warnings, errors, their start-up "
        "line and their final `done:` line.",
    )
    optimizer: str = setting("adam", "The optimizer (momentum: SGD with momentum 0.9).", choices=OPTIMIZER_NAMES)
    learning_rate: float = setting(
        1e-3,
        "Learning rate (the peak rate of a schedule); it wins over a restored checkpoint's, except with "
        "--reduce_lr_metric.",
    )
    lr_schedule: str = setting(
        "constant",
        "cosine: to 0 at the last step; step: x0.1 after each third of the run; warmup_cosine: linear warmup, "
        "then cosine; --learning_rate is the peak.",
        choices=SCHEDULE_NAMES,
    )
    warmup_steps: int = setting(0, "Warmup steps of warmup_cosine (0: a tenth of the run).")
    clip_norm: float | None = option_setting(StepOptions, "clip_norm")
    grad_accum_steps: int = option_setting(StepOptions, "grad_accum_steps")
    on_nonfinite: str = option_setting(
        StepOptions,
        "on_nonfinite",
        "On a NaN/Inf loss (or one above --max_loss): stop with an error (nothing saved), skip the update "
        "and count it in summaries, or roll back: restore the last good checkpoint and skip the batches "
        "since it, up to the spike's (docs/fault-tolerance.md#loss-spikes).",
        choices=NONFINITE_POLICIES,
    )
    max_loss: float | None = option_setting(
        SpikeOptions,
        "max_loss",
        "A finite loss above this is a spike too: --on_nonfinite=stop stops, rollback rolls back.",
    )
    rollback_skip_batches: int = option_setting(
        SpikeOptions,
        "rollback_skip_batches",
        "--on_nonfinite=rollback: skip this many batches more than those from the restored checkpoint "
        "up to and including the spike's.",
    )
    max_rollbacks: int = option_setting(
        SpikeOptions,
        "max_rollbacks",
        f"--on_nonfinite=rollback: after this many rollbacks (at most {MAX_ROLLBACKS}) the next spike stops the "
        "run (nothing saved).",
    )
    # State on disk.
    model_dir: str | None = setting(
        None,
        "Checkpoints (checkpoints/, best/), TensorBoard logs (train/, eval/, hparams at the top), hook state "
        "(hooks/) and metrics.json; restored from when it holds a checkpoint (default: a new temporary "
        "directory).",
    )
    checkpoint_every: int = setting(500, "Save every N steps (and always at the end).")
    max_checkpoints: int = option_setting(CheckpointOptions, "max_checkpoints")
    async_checkpoint: bool = option_setting(CheckpointOptions, "async_checkpoint")
    restore_fallback: bool = option_setting(CheckpointOptions, "restore_fallback")
    reset_optimizer: bool = option_setting(
        CheckpointOptions,
        "reset_optimizer",
        "Resume the weights and step of the checkpoints with fresh "
        "optimizer state, so that --optimizer, --lr_schedule or --mixed_precision "
        "may change.",
    )
    ema_decay: float = setting(
        0.0,
        "Keep an exponential moving average of the weights with this decay "
        "(e.g. 0.999): evaluation, --mode=eval, the best checkpoint and --export_dir use it; "
        "training is unchanged. 0: off.",
    )
    export_dir: str | None = setting(
        None, "After training, write the model here as a SavedModel with a serving_default signature."
    )
    # Decisions from eval metrics (loss or accuracy), made after each evaluation.
    early_stop_metric: str | None = setting(
        None, "Stop when this eval metric (loss or a --metrics name) stops improving."
    )
    early_stop_patience: int = setting(3, "Evaluations without improvement before stopping.")
    early_stop_mode: str = setting(
        "auto",
        "Whether --early_stop_metric should go down or up; auto: max for accuracy, auc, precision, recall, r2, "
        "min otherwise.",
        choices=METRIC_MODES,
    )
    best_checkpoint_metric: str | None = setting(
        None,
        "Also keep the checkpoint with the best value of this eval metric (loss or a --metrics name) in "
        "<model_dir>/best.",
    )
    reduce_lr_metric: str | None = setting(
        None,
        "Multiply the learning rate by --reduce_lr_factor when this eval metric plateaus "
        "(constant schedule only).",
    )
    reduce_lr_patience: int = setting(2, "Evaluations without improvement before reducing.")
    reduce_lr_factor: float = setting(0.5, "Factor for reduce-on-plateau, between 0 and 1.")
    min_learning_rate: float = setting(0.0, "Reduce-on-plateau never goes below this rate.")
    # TensorBoard.
    profile_steps: str | None = setting(
        None, "START,END: profile the steps from global step START to END (TensorBoard's Profile tab)."
    )
    histogram_every: int = setting(
        0,
        "Histograms of every weight in TensorBoard's train run every N steps (loops are cut there, "
        "no retrace); 0: none.",
    )
    # Numerics and speed.
    seed: int = setting(42, "Seed for weights, shuffling and dropout.")
    deterministic: bool = setting(False, "Deterministic ops: bitwise-reproducible runs, somewhat slower.")
    mixed_precision: str = setting(
        "float32",
        "float16 and bfloat16 compute in that type with float32 weights; float16 with dynamic loss scaling.",
        choices=tuple(PRECISION_POLICIES),
    )
    jit_compile: bool = option_setting(StepOptions, "jit_compile")
    peak_tflops: float = setting(
        0.0,
        "The devices' peak TFLOP/s (all replicas together, at the compute precision): progress lines and "
        "TensorBoard then show MFU, the model's training TFLOP/s over it. 0: unknown, no MFU.",
    )
    straggler_margin: float = option_setting(ThroughputOptions, "straggler_margin")
    straggler_loops: int = option_setting(ThroughputOptions, "straggler_loops")
    check_numerics: bool = setting(
        False,
        "tf.debugging.enable_check_numerics: fail at the first NaN or Inf, naming the op that "
        "made it and your source line, or at times the compiled loop's input that carries it "
        "(slow; for debugging).",
    )

    def validate(self) -> None:
        """Raises UserError for the first bad setting; touches nothing on disk."""
        from engine.cli.process.own_packages import own_package  # Imports TensorFlow: only when validating.

        input_lib, models = own_package("input"), own_package("models")
        choose("strategy", self.strategy, STRATEGY_NAMES)
        if models.is_user_model(self.model):  # package.module:function: import it now, before any write.
            try:
                models.get_model_spec(self.model)
            except models.ModelError as error:
                raise UserError(str(error)) from None
        else:
            choose("model", self.model, models.model_names())
        try:
            input_lib.check_dataset_name(self.dataset)
        except input_lib.DataError:
            forms = ", ".join(input_lib.DATASET_FORMS)
            raise UserError(
                f"{choice_message('dataset', self.dataset, input_lib.dataset_names())}, or {forms}"
            ) from None
        choose("optimizer", self.optimizer, OPTIMIZER_NAMES)
        choose("input_pipeline", self.input_pipeline, INPUT_PIPELINES)
        choose("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        choose("communication", self.communication, COMMUNICATIONS)
        choose("mixed_precision", self.mixed_precision, tuple(PRECISION_POLICIES))
        self.validate_numbers()
        spike_problem = SpikeOptions(
            max_loss=self.max_loss,
            rollback_skip_batches=self.rollback_skip_batches,
            max_rollbacks=self.max_rollbacks,
        ).problem(self.on_nonfinite)
        if spike_problem is not None:  # In the library's terms; the command line's edge spells flags.
            raise UserError(spike_problem)
        if self.on_nonfinite == "rollback" and self.strategy == "parameter_server":
            raise UserError(
                "--on_nonfinite=rollback is not supported with --strategy=parameter_server (asynchronous "
                "updates: skipping batches would not be exact); use --on_nonfinite=stop with --max_loss"
            )
        self._validate_problem()
        for name in (
            "cpu_devices",
            "global_batch_size",
            "steps_per_loop",
            "grad_accum_steps",
            "max_checkpoints",
            "ps_shards",
        ):
            at_least(name, getattr(self, name), 1)
        self._check_ps_shards()
        for name in ("eval_every", "checkpoint_every", "log_every", "histogram_every", "device_data_mb"):
            at_least(name, getattr(self, name), 0)
        if self.num_gpus is not None:
            at_least("num_gpus", self.num_gpus, 0)
        if self.train_steps is not None and self.epochs is not None:
            raise UserError(
                f"--train_steps={self.train_steps} and --epochs={self.epochs} are alternatives; pass only one"
            )
        if self.train_steps is not None:
            at_least("train_steps", self.train_steps, 1)
        if self.train_steps is not None and self.train_steps > INT64_MAX // self.global_batch_size:
            raise UserError(_too_many_steps("train_steps", self.train_steps, self.global_batch_size))
        if self.epochs is not None and not self.epochs > 0:
            raise UserError(f"--epochs={self.epochs} must be positive")
        if not self.learning_rate > 0:
            raise UserError(f"--learning_rate={self.learning_rate} must be positive")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UserError(f"--clip_norm={self.clip_norm} must be positive")
        if not self.peak_tflops >= 0.0:  # Also refuses NaN.
            raise UserError(f"--peak_tflops={self.peak_tflops} must not be negative (0: unknown)")
        ThroughputOptions(straggler_margin=self.straggler_margin, straggler_loops=self.straggler_loops)
        if not 0.0 <= self.ema_decay < 1.0:  # Also refuses NaN.
            raise UserError(f"--ema_decay={self.ema_decay} must be in [0, 1), e.g. 0.999; 0 turns it off")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed={self.seed} must be between 0 and {2**32 - 1}")
        # The library's checks name its arguments; the command line's boundary (main_command,
        # job.run, the launcher) prints them as flags (engine.cli.config.flag_names).
        self._validate_dry_run()
        if not self.simulates_a_cluster:  # A simulated cluster has no hosts to resolve.
            self.multi_host.check(self.strategy)
        if self.model_dir:
            from engine.model_dir import check_name

            check_name(self.model_dir)
            # Predict only reads the model_dir: a read-only one (a shared or archived run) will do.
            check_model_dir(self.model_dir, writable=self.mode != "predict")
        if self.export_dir:
            check_model_dir(self.export_dir, flag="export_dir")
        self._validate_schedule_and_hooks()
        self._validate_mode()
        if not isinstance(self.task_params, dict) or not all(isinstance(key, str) for key in self.task_params):
            raise UserError(
                f"task_params={self.task_params!r} must be a mapping of keyword names to values, "
                "e.g. --params_override=task_params.units=128"
            )

    def validate_numbers(self) -> None:
        """Every numeric flag at once, from the fields' types (so a new flag is covered):
        floats finite, integers within what the engine counts, timeouts within int64 ms."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                hint = " (0 waits forever)" if field.name in ("collective_timeout", "startup_timeout") else ""
                raise UserError(f"--{field.name}={value} must be a finite number{hint}")
            if field.name in TIMEOUTS and value > MAX_TIMEOUT_SECONDS:
                raise UserError(
                    f"--{field.name}={value:g} is beyond the longest timeout, {MAX_TIMEOUT_SECONDS:g} seconds"
                )
            limit = {"train_steps": INT64_MAX, "seed": 2**32 - 1, "cpu_devices": MAX_CPU_DEVICES}.get(
                field.name, INT32_MAX
            )
            if isinstance(value, int) and value > limit:
                raise UserError(f"--{field.name}={value} is more than the engine can count; use at most {limit}")
        if not 1 <= self.slurm_port_base <= 65535:
            raise UserError(f"--slurm_port_base={self.slurm_port_base} must be a port, 1-65535")

    def _check_ps_shards(self) -> None:
        """A count no table could take is refused with the flags; the tables' own sizes are
        checked as the model builds them (engine.cli.run.table_shards)."""
        from engine.cli.run.table_shards import MAX_SHARD_VARIABLES  # No TensorFlow there.

        if self.ps_shards > MAX_SHARD_VARIABLES:
            raise UserError(
                f"--ps_shards={self.ps_shards} is over the limit of {MAX_SHARD_VARIABLES} shard variables: each "
                "adds a gather, a gradient and an update to every step (about 90 ms to trace and 1 MiB each, "
                f"measured); use --ps_shards={MAX_SHARD_VARIABLES} or fewer, about as many as ps tasks"
            )

    def _validate_problem(self) -> None:
        """--task, --loss and the data-form flags, each against what it applies to."""
        from engine.objectives import LOSS_NAMES

        if self.loss is not None:
            choose("loss", self.loss, LOSS_NAMES)
        if self.task:
            from engine.user_code import UserCodeError, import_callable

            try:
                import_callable(self.task, setting="task")
            except UserCodeError as error:
                raise UserError(str(error)) from None
        csv_file = self.dataset.endswith(".csv") and not self.task
        if self.label_column is not None and not csv_file:
            raise UserError(f"--label_column={self.label_column} is for --dataset=PATH.csv; drop it")
        if self.eval_file is not None:
            if not csv_file:
                raise UserError(f"--eval_file={self.eval_file} is for --dataset=PATH.csv; drop it")
            if not self.eval_file.endswith(".csv"):
                raise UserError(f"--eval_file={self.eval_file} must be a .csv file with --dataset's columns")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"--eval_fraction={self.eval_fraction} must be in [0, 1); 0 holds out nothing")
        if self.num_classes is not None:
            at_least("num_classes", self.num_classes, 2)
        if self.image_shape is not None:
            if self.dataset not in ("digits", "mnist", "synthetic", "tfrecord") or self.task:
                raise UserError(
                    f"--image_shape={self.image_shape} is for the image sets digits, mnist, synthetic and "
                    "tfrecord; resize other data yourself"
                )
            self.served_image_shape()
        if self.metrics is not None and not all(self.metrics):
            raise UserError(f"--metrics={','.join(self.metrics)} has an empty name")

    @property
    def simulates_a_cluster(self) -> bool:
        """--dry_run --dry_run_workers=N: a cluster of N workers simulated in this process, none resolved."""
        return self.dry_run and self.dry_run_workers > 0

    def _validate_dry_run(self) -> None:
        for name in ("dry_run_workers", "dry_run_ps"):
            value = getattr(self, name)
            if value < 0:
                raise UserError(f"--{name}={value} must not be negative (0: the cluster's)")
            if value and not self.dry_run:
                launch_flag = name.replace("dry_run_", "num_")
                raise UserError(
                    f"--{name}={value} is for --dry_run; to start a cluster on this machine use "
                    f"python -m engine.launch --{launch_flag}={value} -- ..."
                )
        if not self.dry_run:
            return
        if self.dry_run_workers and self.strategy not in ("multi_worker_mirrored", "parameter_server"):
            raise UserError(
                f"--dry_run_workers={self.dry_run_workers} simulates a cluster's workers but --strategy="
                f"{self.strategy} runs on one host; use --strategy=multi_worker_mirrored or parameter_server"
            )
        if self.dry_run_ps and not (self.dry_run_workers and self.strategy == "parameter_server"):
            raise UserError(
                f"--dry_run_ps={self.dry_run_ps} simulates a parameter-server cluster's ps tasks; "
                "use it with --strategy=parameter_server --dry_run_workers=N"
            )
        if self.strategy == "tpu":
            raise UserError("--dry_run simulates CPU and GPU replicas; --strategy=tpu is checked on a TPU only")
        if self.mode in ("eval", "continuous_eval", "predict"):
            raise UserError(f"--dry_run checks a training config; drop --mode={self.mode}")
        if self.strategy == "parameter_server" and not self.dry_run_workers and self.multi_host.cluster is None:
            raise UserError(
                "--dry_run --strategy=parameter_server simulates a cluster: pass --dry_run_workers=N (and "
                "--dry_run_ps=M), or the cluster's flags or TF_CONFIG as its chief is given them"
            )
        if self.simulates_a_cluster and self.multi_host.cluster is not None:
            raise UserError(
                f"--dry_run_workers={self.dry_run_workers} simulates a cluster but one is given (the cluster "
                "flags or TF_CONFIG); drop one of them"
            )

    def _validate_mode(self) -> None:
        choose("mode", self.mode, MODES)
        if not self.eval_timeout > 0:
            raise UserError(f"--eval_timeout={self.eval_timeout} must be positive (seconds)")
        needs_eval = [
            f"--{name}={getattr(self, name)}"
            for name in ("early_stop_metric", "best_checkpoint_metric", "reduce_lr_metric")
            if getattr(self, name)
        ]
        if self.mode == "train" and needs_eval:
            raise UserError(
                f"--mode=train runs no evaluation but {needs_eval[0]} needs one; "
                "use --mode=train_and_eval or drop it"
            )
        if self.mode in ("eval", "continuous_eval") and not self.model_dir:
            raise UserError(f"--mode={self.mode} evaluates the checkpoints of a --model_dir; pass one")
        if self.mode == "predict":
            check_predict_paths(self.model_dir, self.predict_input, self.predict_output)
        elif self.predict_input or self.predict_output:
            raise UserError("--predict_input/--predict_output need --mode=predict")

    def _validate_schedule_and_hooks(self) -> None:
        choose("lr_schedule", self.lr_schedule, SCHEDULE_NAMES)
        choose("early_stop_mode", self.early_stop_mode, METRIC_MODES)
        at_least("warmup_steps", self.warmup_steps, 0)
        for name in ("early_stop_patience", "reduce_lr_patience"):
            at_least(name, getattr(self, name), 1)
        for name in ("early_stop_metric", "best_checkpoint_metric", "reduce_lr_metric"):
            metric = getattr(self, name)
            if metric is None:
                continue
            if self.eval_every == 0 and name != "best_checkpoint_metric":
                raise UserError(
                    f"--{name}={metric} needs evaluations during training; "
                    "set --eval_every to a positive number of steps"
                )
        if not 0.0 < self.reduce_lr_factor < 1.0:
            raise UserError(f"--reduce_lr_factor={self.reduce_lr_factor} must be between 0 and 1")
        if self.min_learning_rate < 0:
            raise UserError(f"--min_learning_rate={self.min_learning_rate} must not be negative")
        self.profile_window()
        if self.reduce_lr_metric is not None and self.lr_schedule != "constant":
            raise UserError(
                f"--reduce_lr_metric={self.reduce_lr_metric} changes the learning rate itself and "
                f"cannot be combined with --lr_schedule={self.lr_schedule}; use one of them"
            )

    def served_image_shape(self) -> tuple[int, int, int] | None:
        """--image_shape as (H, W, C), or None when not given."""
        if self.image_shape is None:
            return None
        try:
            height, width, channels = (int(part) for part in self.image_shape.split(","))
        except ValueError:
            height = width = channels = 0
        if min(height, width, channels) < 1 or channels not in (1, 3):
            raise UserError(
                f"--image_shape={self.image_shape} must be H,W,C of positive sizes with 1 or 3 channels, "
                "e.g. --image_shape=32,32,3"
            )
        return height, width, channels

    def profile_window(self) -> tuple[int, int] | None:
        """--profile_steps as (START, END), or None when not profiling."""
        if not self.profile_steps:
            return None
        parts = self.profile_steps.split(",")
        try:
            start, end = (int(part) for part in parts)
        except ValueError:
            start = end = -1
        if len(parts) != 2 or not 0 <= start < end:
            raise UserError(
                f"--profile_steps={self.profile_steps} must be START,END with "
                "0 <= START < END, e.g. --profile_steps=100,110"
            )
        return start, end

    @functools.cached_property
    def multi_host(self) -> MultiHostOptions:
        """The cluster (from the flags, TF_CONFIG or Slurm) and multi-host settings;
        no cluster for the single-host strategies unless flags name one. Resolved once per
        RunConfig: the checks, the console, the strategy and the error messages share it."""
        from engine.cli.process.preemption import signals_left_pending
        from engine.cluster import resolve_cluster
        from engine.cluster.multi_host import MultiHostOptions

        cluster = None
        if (
            self.strategy in ("multi_worker_mirrored", "parameter_server")
            or self.worker_hosts
            or self.ps_hosts
            or self.chief_host
            or self.task_type is not None  # A task of a cluster: refused when none is given.
            or self.task_index is not None
        ):
            cluster = resolve_cluster(**settings_of(self, CLUSTER_SETTINGS))
        return MultiHostOptions(
            cluster=cluster,
            communication=self.communication,
            collective_timeout=self.collective_timeout,
            tpu=self.tpu,
            startup_timeout=self.startup_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            startup_guard=signals_left_pending,
            # A start-up that times out reports where it waited (engine.diagnostics.DIAGNOSTICS_DIR).
            diagnostics_dir=os.path.join(self.model_dir, "diagnostics") if self.model_dir else None,
        )

    def total_steps(self, num_train_examples: int | None) -> int:
        """--train_steps, or --epochs worth of full global batches (by default `DEFAULT_EPOCHS`, and at
        least `DEFAULT_MIN_STEPS` steps)."""
        if self.train_steps is not None:
            return self.train_steps
        if num_train_examples is None:
            raise UserError(f"--dataset={self.dataset} does not know its size; pass --train_steps")
        epochs = self.epochs if self.epochs is not None else DEFAULT_EPOCHS
        steps = max(1, int(epochs * num_train_examples) // self.global_batch_size)
        if self.epochs is None:
            steps = max(steps, DEFAULT_MIN_STEPS)
        if steps > INT64_MAX // self.global_batch_size:
            raise UserError(_too_many_steps("epochs", self.epochs, self.global_batch_size))
        return steps


def _too_many_steps(flag: str, value: Any, global_batch_size: int) -> str:
    most = INT64_MAX // global_batch_size
    return (
        f"--{flag}={value} trains beyond what the engine can count: at --global_batch_size="
        f"{global_batch_size}, a run counts at most {most} steps (int64 examples); train fewer"
    )
