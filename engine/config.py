"""`RunConfig`: the validated settings of one run of `engine.main`.

Every user mistake in the flags is caught here, before TensorFlow starts
and before anything is written, as a `UserError` naming the bad value.
"""

from __future__ import annotations

import dataclasses
import math
import os

from engine.environment import PRECISION_POLICIES
from engine.errors import UserError
from engine.strategy import STRATEGY_NAMES

OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")
EVAL_METRIC_NAMES = ("loss", "accuracy")  # What job.py evaluates.
DEFAULT_EPOCHS = 20.0
# Steps per compiled call: the Trainer's default and the CLI's (--steps_per_loop).
DEFAULT_STEPS_PER_LOOP = 50
MODES = ("train", "eval", "train_and_eval", "continuous_eval")  # TF Model Garden's names.


@dataclasses.dataclass(frozen=True)
class RunConfig:
    strategy: str = "default"
    cpu_devices: int = 1
    num_gpus: int | None = None
    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    input_pipeline: str = "per_replica"
    global_batch_size: int = 64
    train_steps: int | None = None
    epochs: float | None = None
    steps_per_loop: int = DEFAULT_STEPS_PER_LOOP
    log_every: int = 0
    eval_every: int = 100
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip_norm: float | None = None
    grad_accum_steps: int = 1
    on_nonfinite: str = "stop"
    model_dir: str | None = None
    checkpoint_every: int = 500
    max_checkpoints: int = 3
    restore_fallback: bool = False
    reset_optimizer: bool = False
    export_dir: str | None = None
    early_stop_metric: str | None = None
    early_stop_patience: int = 3
    early_stop_mode: str = "auto"
    best_checkpoint_metric: str | None = None
    reduce_lr_metric: str | None = None
    reduce_lr_patience: int = 2
    reduce_lr_factor: float = 0.5
    min_learning_rate: float = 0.0
    profile_steps: str | None = None
    histogram_every: int = 0
    seed: int = 42
    deterministic: bool = False
    mixed_precision: str = "float32"
    jit_compile: bool = False
    # Several machines (engine.cluster, engine.cluster.multi_host).
    worker_hosts: list[str] | None = None
    ps_hosts: list[str] | None = None
    chief_host: str | None = None
    task_type: str | None = None
    task_index: int | None = None
    cluster_resolver: str = "tf_config"
    slurm_port_base: int = 8888
    communication: str = "auto"
    collective_timeout: float = 300.0
    tpu: str | None = None
    check_numerics: bool = False
    mode: str = "train_and_eval"
    eval_timeout: float = 3600.0
    startup_timeout: float = 300.0

    @classmethod
    def from_flags(cls, flag_values) -> "RunConfig":
        names = [field.name for field in dataclasses.fields(cls)]
        config = cls(**{name: flag_values[name].value for name in names})
        config.validate()
        return config

    def validate(self) -> None:
        """Raises UserError for the first bad setting; touches nothing on disk."""
        from engine.own_packages import own_package  # Heavy imports stay out of flag parsing.

        input_lib, models = own_package("input"), own_package("models")
        _choose("strategy", self.strategy, STRATEGY_NAMES)
        if models.is_user_model(self.model):  # package.module:function: import it now, before any write.
            try:
                models.get_model_spec(self.model)
            except models.ModelError as error:
                raise UserError(str(error)) from None
        else:
            _choose("model", self.model, models.model_names())
        _choose("dataset", self.dataset, input_lib.dataset_names())
        _choose("optimizer", self.optimizer, OPTIMIZER_NAMES)
        _choose("input_pipeline", self.input_pipeline, ("per_replica", "global"))
        _choose("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        _choose("mixed_precision", self.mixed_precision, tuple(PRECISION_POLICIES))
        for name in ("cpu_devices", "global_batch_size", "steps_per_loop",
                     "grad_accum_steps", "max_checkpoints"):
            _at_least(name, getattr(self, name), 1)
        for name in ("eval_every", "checkpoint_every", "log_every", "histogram_every"):
            _at_least(name, getattr(self, name), 0)
        if self.num_gpus is not None:
            _at_least("num_gpus", self.num_gpus, 0)
        if self.train_steps is not None and self.epochs is not None:
            raise UserError(
                f"--train_steps={self.train_steps} and --epochs={self.epochs} are "
                "alternatives; pass only one"
            )
        if self.train_steps is not None:
            _at_least("train_steps", self.train_steps, 1)
        # `not x > 0` also refuses NaN, which every comparison calls False.
        for name in ("epochs", "learning_rate", "clip_norm", "collective_timeout",
                     "reduce_lr_factor", "min_learning_rate"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise UserError(f"--{name}={value} must be a finite number")
        if self.epochs is not None and not self.epochs > 0:
            raise UserError(f"--epochs={self.epochs} must be positive")
        if not self.learning_rate > 0:
            raise UserError(f"--learning_rate={self.learning_rate} must be positive")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UserError(f"--clip_norm={self.clip_norm} must be positive")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed={self.seed} must be between 0 and {2**32 - 1}")
        self.multi_host_options().check(self.strategy)
        if self.model_dir:
            from engine.model_dir import check_name

            check_name(self.model_dir)
            check_model_dir(self.model_dir)
        if self.export_dir:
            check_model_dir(self.export_dir, flag="export_dir")
        self._validate_schedule_and_hooks()
        self._validate_mode()

    def _validate_mode(self) -> None:
        _choose("mode", self.mode, MODES)
        if self.eval_timeout <= 0:
            raise UserError(f"--eval_timeout={self.eval_timeout} must be positive (seconds)")
        needs_eval = [f"--{name}={getattr(self, name)}" for name in
                      ("early_stop_metric", "best_checkpoint_metric", "reduce_lr_metric") if getattr(self, name)]
        if self.mode == "train" and needs_eval:
            raise UserError(f"--mode=train runs no evaluation but {needs_eval[0]} needs one; "
                            "use --mode=train_and_eval or drop it")
        if self.mode in ("eval", "continuous_eval") and not self.model_dir:
            raise UserError(f"--mode={self.mode} evaluates the checkpoints of a --model_dir; pass one")

    def _validate_schedule_and_hooks(self) -> None:
        from engine.hooks.metric_watch import MODES  # Imports TensorFlow: not at flag parsing.
        from engine.schedules import SCHEDULE_NAMES

        _choose("lr_schedule", self.lr_schedule, SCHEDULE_NAMES)
        _choose("early_stop_mode", self.early_stop_mode, MODES)
        _at_least("warmup_steps", self.warmup_steps, 0)
        for name in ("early_stop_patience", "reduce_lr_patience"):
            _at_least(name, getattr(self, name), 1)
        for name in ("early_stop_metric", "best_checkpoint_metric", "reduce_lr_metric"):
            metric = getattr(self, name)
            if metric is None:
                continue
            _choose(name, metric, EVAL_METRIC_NAMES)
            if self.eval_every == 0 and name != "best_checkpoint_metric":
                raise UserError(f"--{name}={metric} needs evaluations during training; "
                                "set --eval_every to a positive number of steps")
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
            raise UserError(f"--profile_steps={self.profile_steps} must be START,END with "
                            "0 <= START < END, e.g. --profile_steps=100,110")
        return start, end

    def multi_host_options(self):
        """The cluster (from the flags, TF_CONFIG or Slurm) and multi-host settings;
        no cluster for the single-host strategies unless flags name one."""
        from engine.cluster import resolve_cluster
        from engine.cluster.multi_host import MultiHostOptions

        cluster = None
        if self.strategy in ("multi_worker_mirrored", "parameter_server") or self.worker_hosts \
                or self.ps_hosts or self.chief_host or self.task_type == "evaluator":
            cluster = resolve_cluster(
                worker_hosts=self.worker_hosts, ps_hosts=self.ps_hosts, chief_host=self.chief_host,
                task_type=self.task_type, task_index=self.task_index,
                cluster_resolver=self.cluster_resolver, slurm_port_base=self.slurm_port_base,
            )
        return MultiHostOptions(
            cluster=cluster, communication=self.communication,
            collective_timeout=self.collective_timeout, tpu=self.tpu,
            startup_timeout=self.startup_timeout,
        )

    def total_steps(self, num_train_examples: int | None) -> int:
        """--train_steps, or --epochs (default 10) worth of full global batches."""
        if self.train_steps is not None:
            return self.train_steps
        if num_train_examples is None:
            raise UserError(
                f"--dataset={self.dataset} does not know its size; pass --train_steps"
            )
        epochs = self.epochs if self.epochs is not None else DEFAULT_EPOCHS
        return max(1, int(epochs * num_train_examples) // self.global_batch_size)


def check_model_dir(model_dir: str, flag: str = "model_dir") -> None:
    """A model_dir (or export_dir) must be a writable directory, or creatable as one."""
    path = os.path.abspath(model_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--{flag}={model_dir} is a file; pass a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--{flag}={model_dir} is not writable ({existing}); pass a writable directory")


def _choose(name: str, value: str, choices) -> None:
    if value not in choices:
        raise UserError(f"unknown --{name}={value!r}; choose one of: {', '.join(choices)}")


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UserError(f"--{name}={value} must be at least {minimum}")
