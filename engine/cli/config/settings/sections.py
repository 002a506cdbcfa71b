"""`RunConfig`'s sections: each a frozen dataclass of the settings of one concern, each setting a
field with its default, help, choices and least value (`fields.setting`), each section with its own
`check` (what `RunConfig.validate` runs; what crosses sections is there). Flags and config-file keys
keep the settings' flat names; `TITLE` heads the section in `--help` and docs/flags.md.
Imports no TensorFlow (`ProblemSettings.check` imports the model and data packages)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from engine.cli.config.settings.fields import (
    COMMUNICATIONS,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_DEVICE_DATA_MB,
    DEFAULT_EPOCHS,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_MIN_STEPS,
    DEFAULT_SLURM_PORT_BASE,
    DEFAULT_STARTUP_TIMEOUT,
    INPUT_PIPELINES,
    INT64_MAX,
    MAX_ROLLBACKS,
    METRIC_MODES,
    MODES,
    NONFINITE_POLICIES,
    OPTIMIZER_NAMES,
    PRECISION_POLICIES,
    RESOLVERS,
    SCHEDULE_NAMES,
    STRATEGY_NAMES,
    check_fields,
    choice_message,
    choose,
    option_setting,
    setting,
)
from engine.cli.config.settings.paths import check_model_dir
from engine.errors import UserError
from engine.options import (
    DATA_SERVICE_MODES,
    Cadence,
    CheckpointOptions,
    DataService,
    SpikeOptions,
    StepOptions,
    ThroughputOptions,
    default_of,
    help_of,
)

# The most --vocab_size: input.clicks.MAX_VOCAB_SIZE (ids in float32 columns), without importing it.
MAX_VOCAB_SIZE = 1 << 24


@dataclasses.dataclass(frozen=True)
class DeviceSettings:
    """The tf.distribute strategy and the devices it runs on (one host's part of a cluster)."""

    TITLE: ClassVar[str] = "Strategy and devices"

    strategy: str = setting(
        "default",
        "The tf.distribute strategy; multi_worker_mirrored, parameter_server and tpu span several machines.",
        choices=STRATEGY_NAMES,
    )
    cpu_devices: int = setting(
        1,
        "Logical CPU devices to split the host CPU into; `mirrored` uses them as replicas when there is no GPU.",
        minimum=1,
    )
    num_gpus: int | None = setting(None, "GPUs for mirrored/one_device (default: all visible).", minimum=0)
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

    def check(self) -> None:
        """Its choices and counts, then the multi-host settings in the library's own check
        (`MultiHostOptions.check_settings`: the timeouts, the TPU); the cluster's comes once resolved."""
        from engine.cluster.multi_host import MultiHostOptions

        check_fields(self)
        MultiHostOptions(
            communication=self.communication,
            collective_timeout=self.collective_timeout,
            tpu=self.tpu,
            startup_timeout=self.startup_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
        ).check_settings(self.strategy)


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """Which cluster a process is in: flags `engine.cli.config.cluster_flags` defines for `engine.server`
    too, resolved by `engine.cluster.resolve` once per command (`engine.cli.config.settings.cluster`)."""

    TITLE: ClassVar[str] = "Several machines"

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
    data_service: str | None = setting(
        None,
        "grpc://HOST:PORT of a tf.data service dispatcher (python -m engine.data_service --dispatcher, or "
        "python -m engine.launch --data_workers=N): the training input runs on its data workers, the run "
        "only reads the batches. One data worker: the batches of local input; several: see "
        "docs/several-machines.md.",
    )
    data_service_mode: str = setting(
        default_of(DataService, "processing_mode"),
        help_of(DataService, "processing_mode"),
        choices=DATA_SERVICE_MODES,
    )

    def check(self) -> None:
        check_fields(self)
        if not 1 <= self.slurm_port_base <= 65535:
            raise UserError(f"--slurm_port_base={self.slurm_port_base} must be a port, 1-65535")
        if self.data_service is not None:
            try:
                DataService(address=self.data_service)
            except UserError:
                raise UserError(
                    f"--data_service={self.data_service} must be a dispatcher's grpc://HOST:PORT "
                    "(python -m engine.data_service --dispatcher prints it)"
                ) from None

    def data_service_option(self) -> DataService | None:
        """The library's option for --data_service (None: input made in the training process)."""
        if self.data_service is None:
            return None
        return DataService(address=self.data_service, processing_mode=self.data_service_mode)

    @property
    def names_a_cluster(self) -> bool:
        """Whether these flags name a cluster task (a task of none given is refused when resolved)."""
        return bool(
            self.worker_hosts
            or self.ps_hosts
            or self.chief_host
            or self.task_type is not None
            or self.task_index is not None
        )


@dataclasses.dataclass(frozen=True)
class CommandSettings:
    """What this invocation does (TF Model Garden's modes, and predict) and how it reads its settings."""

    TITLE: ClassVar[str] = "What the command does"

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
        "step and metrics.json); train_and_eval; continuous_eval: every checkpoint once, in order (each "
        "written since its last evaluation), until the final step's.",
        choices=MODES,
    )
    eval_timeout: float = setting(
        3600.0, "continuous_eval: exit after this many seconds without a new checkpoint."
    )
    predict_input: str | None = setting(
        None,
        "--mode=predict: the examples, an .npz with an x array or a .csv of numbers (a header row, one "
        "example a row), each example the model's input shape or that many values; uint8 pixels are scaled "
        "by 1/255 as in training, floats taken as they are. A model trained on a table with text, blanks or "
        "dates takes its raw rows (.csv or .parquet, columns in any order) and writes class names and "
        "probabilities.",
    )
    predict_output: str | None = setting(
        None, "--mode=predict: where the model's outputs go, one row per example: a new .npy or .csv file."
    )

    def check(self) -> None:
        check_fields(self)
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
        if not self.eval_timeout > 0:
            raise UserError(f"--eval_timeout={self.eval_timeout} must be positive (seconds)")
        if self.mode != "predict" and (self.predict_input or self.predict_output):
            raise UserError("--predict_input/--predict_output need --mode=predict")

    @property
    def simulates_a_cluster(self) -> bool:
        """--dry_run --dry_run_workers=N: a cluster of N workers simulated in this process, none resolved."""
        return self.dry_run and self.dry_run_workers > 0


@dataclasses.dataclass(frozen=True)
class ProblemSettings:
    """The model, the data, the loss and the metrics (strings, not enums: they also take
    package.module:function)."""

    TITLE: ClassVar[str] = "The problem: model, data, loss, metrics"

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
        "PATH.csv or PATH.parquet (a table with --label_column: numbers, text categories, dates, blanks); "
        "tfds:NAME[/CONFIG] (prepared in --data_dir); or "
        "package.module:function returning (train, eval) tf.data.Datasets of unbatched (features, labels) "
        "or an input.DataSource.",
    )
    data_dir: str | None = setting(
        None, "Where mnist.npz, the TFRecord files or the tensorflow-datasets sets are."
    )
    label_column: str | None = setting(
        None, "--dataset=PATH.csv or .parquet: the column of labels; every other is a feature."
    )
    column_types: list[str] | None = setting(
        None,
        "--dataset=PATH.csv or .parquet: NAME:TYPE for columns whose inferred type is not the one meant, "
        "comma-separated, TYPE one of number, boolean, category, date, identifier, text, drop "
        "(identifier and drop are left out; text reads a column's words), e.g. zip:category,id:drop (default: "
        "each type inferred "
        "from the training split, shown at the start of the run and kept in inputs.json).",
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
        "(wide_deep's): a parameter_server cluster spreads them over its ps tasks. A model_dir keeps its count "
        "(which restores onto any number of ps tasks); another count on a model_dir with checkpoints re-cuts "
        "the tables (and their optimizer slots) on restore. At most a table's rows, and 1024 shard variables "
        "in all the tables (each adds a gather and an update to every step).",
        minimum=1,
    )
    vocab_size: int | None = setting(
        None,
        "The clicks example's ids: --dataset=clicks hashes its categorical features into this many and "
        "--model=wide_deep sizes its tables to it (default 100,000; at most 2**24, exact in float32 columns). "
        "Part of the model: a model_dir with checkpoints keeps it.",
        minimum=1,
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
        None,
        "Classes of integer labels (default: the largest label + 1; tfrecord: of the eval files).",
        minimum=2,
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
        minimum=0,
    )

    def check(self) -> None:
        """The model, data and loss names (importing a named package.module:function now, before any
        write), and the data-form flags against what they apply to."""
        check_fields(self)
        self._check_names()
        csv_file = self.dataset.endswith((".csv", ".parquet")) and not self.task
        if self.label_column is not None and not csv_file:
            raise UserError(f"--label_column={self.label_column} is for --dataset=PATH.csv; drop it")
        if self.column_types and not csv_file:
            raise UserError(f"--column_types={','.join(self.column_types)} is for --dataset=PATH.csv; drop it")
        if self.eval_file is not None:
            if not csv_file:
                raise UserError(f"--eval_file={self.eval_file} is for --dataset=PATH.csv; drop it")
            if not self.eval_file.endswith((".csv", ".parquet")):
                raise UserError(f"--eval_file={self.eval_file} must be a .csv file with --dataset's columns")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"--eval_fraction={self.eval_fraction} must be in [0, 1); 0 holds out nothing")
        if self.image_shape is not None:
            if self.dataset not in ("digits", "mnist", "synthetic", "tfrecord") or self.task:
                raise UserError(
                    f"--image_shape={self.image_shape} is for the image sets digits, mnist, synthetic and "
                    "tfrecord; resize other data yourself"
                )
            self.served_image_shape()
        if self.metrics is not None and not all(self.metrics):
            raise UserError(f"--metrics={','.join(self.metrics)} has an empty name")
        self._check_ps_shards()
        self._check_vocab_size()
        if not isinstance(self.task_params, dict) or not all(isinstance(key, str) for key in self.task_params):
            raise UserError(
                f"task_params={self.task_params!r} must be a mapping of keyword names to values, "
                "e.g. --params_override=task_params.units=128"
            )

    def _check_names(self) -> None:
        """--model, --dataset, --loss and --task: known names, or code that imports."""
        from engine.cli.process.own_packages import own_package  # Imports TensorFlow: only when validating.
        from engine.objectives import LOSS_NAMES

        input_lib, models = own_package("input"), own_package("models")
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
        if self.loss is not None:
            choose("loss", self.loss, LOSS_NAMES)
        if self.task:
            from engine.user_code import UserCodeError, import_callable

            try:
                import_callable(self.task, setting="task")
            except UserCodeError as error:
                raise UserError(str(error)) from None

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

    def _check_vocab_size(self) -> None:
        """--vocab_size where it applies (the clicks data, the wide_deep tables), at a size the
        data's float32 columns hold exactly."""
        if self.vocab_size is None:
            return
        if self.dataset != "clicks" and self.model != "wide_deep":
            raise UserError(
                f"--vocab_size={self.vocab_size} is for --dataset=clicks and --model=wide_deep; drop it"
            )
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise UserError(
                f"--vocab_size={self.vocab_size} is over {MAX_VOCAB_SIZE} (2**24): the clicks data hold ids in "
                f"float32 columns, exact up to there; use --vocab_size={MAX_VOCAB_SIZE} or fewer"
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


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """How long the run trains, in what batches, and how often it reports."""

    TITLE: ClassVar[str] = "Length, batches and output"

    global_batch_size: int = setting(
        64, "Examples per step over all replicas (must divide by replicas x --grad_accum_steps).", minimum=1
    )
    train_steps: int | None = setting(None, "Global steps to train to (alternative to --epochs).", minimum=1)
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
        minimum=1,
    )
    log_every: int = setting(
        0,
        "Progress line (step, loss, metrics, examples/sec, steps/sec, ETA) every N steps (loops are cut to "
        "match; steps_per_loop stays the longest); 0: one line per compiled loop. A progress bar too when "
        "stdout is a terminal.",
        minimum=0,
    )
    eval_every: int = setting(100, "Evaluate every N steps; 0 evaluates only at the end.", minimum=0)
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

    def check(self) -> None:
        check_fields(self)
        if self.train_steps is not None and self.epochs is not None:
            raise UserError(
                f"--train_steps={self.train_steps} and --epochs={self.epochs} are alternatives; pass only one"
            )
        if self.train_steps is not None and self.train_steps > INT64_MAX // self.global_batch_size:
            raise UserError(_too_many_steps("train_steps", self.train_steps, self.global_batch_size))
        if self.epochs is not None and not self.epochs > 0:
            raise UserError(f"--epochs={self.epochs} must be positive")

    def total_steps(self, num_train_examples: int | None, dataset: str) -> int:
        """--train_steps, or --epochs worth of full global batches (by default `DEFAULT_EPOCHS`, and at
        least `DEFAULT_MIN_STEPS` steps) of `dataset`'s train split."""
        if self.train_steps is not None:
            return self.train_steps
        if num_train_examples is None:
            raise UserError(f"--dataset={dataset} does not know its size; pass --train_steps")
        epochs = self.epochs if self.epochs is not None else DEFAULT_EPOCHS
        steps = max(1, int(epochs * num_train_examples) // self.global_batch_size)
        if self.epochs is None:
            steps = max(steps, DEFAULT_MIN_STEPS)
        if steps > INT64_MAX // self.global_batch_size:
            raise UserError(_too_many_steps("epochs", self.epochs, self.global_batch_size))
        return steps


@dataclasses.dataclass(frozen=True)
class OptimizationSettings:
    """The optimizer, its learning rate and schedule, and how the step makes its update."""

    TITLE: ClassVar[str] = "Optimization"

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
    warmup_steps: int = setting(0, "Warmup steps of warmup_cosine (0: a tenth of the run).", minimum=0)
    clip_norm: float | None = option_setting(StepOptions, "clip_norm")
    grad_accum_steps: int = option_setting(StepOptions, "grad_accum_steps", minimum=1)

    def check(self) -> None:
        check_fields(self)
        if not self.learning_rate > 0:
            raise UserError(f"--learning_rate={self.learning_rate} must be positive")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UserError(f"--clip_norm={self.clip_norm} must be positive")


@dataclasses.dataclass(frozen=True)
class SpikeSettings:
    """What a NaN/Inf or too large loss does (`engine.options.SpikeOptions`, `StepOptions.on_nonfinite`)."""

    TITLE: ClassVar[str] = "Loss spikes"

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

    def check(self) -> None:
        """The spike options in the library's own check (`SpikeOptions`), in its terms; the command
        line's edge spells them as flags."""
        check_fields(self)
        options = SpikeOptions(
            max_loss=self.max_loss,
            rollback_skip_batches=self.rollback_skip_batches,
            max_rollbacks=self.max_rollbacks,
        )
        problem = options.problem(self.on_nonfinite)
        if problem is not None:
            raise UserError(problem)


@dataclasses.dataclass(frozen=True)
class StateSettings:
    """Where the run's state goes: checkpoints, the export, the weights' moving average."""

    TITLE: ClassVar[str] = "State on disk"

    model_dir: str | None = setting(
        None,
        "Checkpoints (checkpoints/, best/), TensorBoard logs (train/, eval/, hparams at the top), hook state "
        "(hooks/) and metrics.json; restored from when it holds a checkpoint (default: a new temporary "
        "directory).",
    )
    checkpoint_every: int = setting(500, "Save every N steps (and always at the end).", minimum=0)
    max_checkpoints: int = option_setting(CheckpointOptions, "max_checkpoints", minimum=1)
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

    def check(self, *, writable: bool = True) -> None:
        """The model_dir's name, and each directory a directory (`writable`: the model_dir too)."""
        check_fields(self)
        if not 0.0 <= self.ema_decay < 1.0:  # Also refuses NaN.
            raise UserError(f"--ema_decay={self.ema_decay} must be in [0, 1), e.g. 0.999; 0 turns it off")
        if self.model_dir:
            from engine.model_dir import check_name

            check_name(self.model_dir)
            check_model_dir(self.model_dir, writable=writable)
        if self.export_dir:
            check_model_dir(self.export_dir, flag="export_dir")


@dataclasses.dataclass(frozen=True)
class DecisionSettings:
    """Decisions from eval metrics (loss or a --metrics name), made after each evaluation."""

    TITLE: ClassVar[str] = "Decisions from evaluations"

    early_stop_metric: str | None = setting(
        None, "Stop when this eval metric (loss or a --metrics name) stops improving."
    )
    early_stop_patience: int = setting(3, "Evaluations without improvement before stopping.", minimum=1)
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
    reduce_lr_patience: int = setting(2, "Evaluations without improvement before reducing.", minimum=1)
    reduce_lr_factor: float = setting(0.5, "Factor for reduce-on-plateau, between 0 and 1.")
    min_learning_rate: float = setting(0.0, "Reduce-on-plateau never goes below this rate.")

    METRICS: ClassVar[tuple[str, ...]] = ("early_stop_metric", "best_checkpoint_metric", "reduce_lr_metric")

    def check(self) -> None:
        check_fields(self)
        if not 0.0 < self.reduce_lr_factor < 1.0:
            raise UserError(f"--reduce_lr_factor={self.reduce_lr_factor} must be between 0 and 1")
        if self.min_learning_rate < 0:
            raise UserError(f"--min_learning_rate={self.min_learning_rate} must not be negative")

    def watched(self, *names: str) -> list[str]:
        """`--NAME=METRIC` of each of `names` (default: every metric flag) that is set."""
        return [f"--{name}={getattr(self, name)}" for name in names or self.METRICS if getattr(self, name)]


@dataclasses.dataclass(frozen=True)
class SummarySettings:
    """What TensorBoard shows besides the scalars: the profiler's window, weight histograms."""

    TITLE: ClassVar[str] = "TensorBoard"

    profile_steps: str | None = setting(
        None, "START,END: profile the steps from global step START to END (TensorBoard's Profile tab)."
    )
    histogram_every: int = setting(
        0,
        "Histograms of every weight in TensorBoard's train run every N steps (loops are cut there, "
        "no retrace); 0: none.",
        minimum=0,
    )

    def check(self) -> None:
        check_fields(self)
        self.profile_window()

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


@dataclasses.dataclass(frozen=True)
class NumericSettings:
    """Seeds, determinism, precision, XLA, and what the progress lines measure speed against."""

    TITLE: ClassVar[str] = "Numerics and speed"

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

    def check(self) -> None:
        check_fields(self)
        if not self.peak_tflops >= 0.0:  # Also refuses NaN.
            raise UserError(f"--peak_tflops={self.peak_tflops} must not be negative (0: unknown)")
        ThroughputOptions(straggler_margin=self.straggler_margin, straggler_loops=self.straggler_loops)
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed={self.seed} must be between 0 and {2**32 - 1}")


def _too_many_steps(flag: str, value: Any, global_batch_size: int) -> str:
    most = INT64_MAX // global_batch_size
    return (
        f"--{flag}={value} trains beyond what the engine can count: at --global_batch_size="
        f"{global_batch_size}, a run counts at most {most} steps (int64 examples); train fewer"
    )
