"""How a setting is written: a `RunConfig` field (`setting`, `option_setting`) with its default, help and
choices in its metadata; the command line's choices, limits and the groups of setting names; the
one-line checks the sections share. Imports no TensorFlow."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.cluster.resolve import DEFAULT_SLURM_PORT_BASE, RESOLVERS  # noqa: F401 (re-exported)
from engine.errors import UserError
from engine.options import (  # noqa: F401 (re-exported: the command line's names in one place)
    COMMUNICATIONS,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_MAX_ROLLBACKS,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_STEPS_PER_LOOP,
    MAX_ROLLBACKS,
    METRIC_MODES,
    MULTI_HOST_STRATEGIES,
    NONFINITE_POLICIES,
    PRECISION_POLICIES,
    SCHEDULE_NAMES,
    SINGLE_HOST_STRATEGIES,
    STRATEGY_NAMES,
    default_of,
    help_of,
)

# The library's own choices and defaults (engine.options); the command line's below.
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")
INPUT_PIPELINES = ("per_replica", "global")
MODES = (
    "train",
    "eval",
    "train_and_eval",
    "continuous_eval",
    "predict",
)  # TF Model Garden's names, and predict.
DEFAULT_EPOCHS = 20.0
# The fewest steps of a run whose length is not given: 20 epochs of a 400-row table are 125 steps
# at the default batch, too few to fit it (wine: 0.94 accuracy at 60 steps, 1.0 at 160).
DEFAULT_MIN_STEPS = 500
# Per-device memory (MiB) up to which an in-memory train split is kept on the replicas' devices.
DEFAULT_DEVICE_DATA_MB = 1024
# What the engine can count: loop lengths, cadences and batch sizes are int32 in the compiled
# loop and tf.data; steps and stream positions (step x global batch) are int64.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# The longest timeout (about 31 years): TensorFlow takes timeouts in int64 milliseconds.
MAX_TIMEOUT_SECONDS = 1e9
TIMEOUTS = ("collective_timeout", "startup_timeout", "heartbeat_timeout", "eval_timeout")
# Logical CPU devices to split the host into: each is a replica with its own copy of the model.
MAX_CPU_DEVICES = 1024

# The settings `engine.cli.config.cluster_flags` defines for `engine.server` too;
# `engine.cli.config.flags` defines the rest.
CLUSTER_SETTINGS = (
    "worker_hosts",
    "ps_hosts",
    "chief_host",
    "task_type",
    "task_index",
    "cluster_resolver",
    "slurm_port_base",
)
# The settings that say how this command reads its settings or what it does instead of a run:
# flags only, never in a config file.
COMMAND_LINE_ONLY_SETTINGS = (
    "print_config",
    "dry_run",
    "dry_run_workers",
    "dry_run_ps",
    "config_file",
    "params_override",
)
# The settings that belong to one invocation: a rerun on a model_dir never inherits them from the
# `config.yaml` stored there (engine.cli.config.config_files), and that file does not hold them.
PER_INVOCATION_SETTINGS = (
    "mode",
    *COMMAND_LINE_ONLY_SETTINGS,
    "model_dir",
    "export_dir",
    "predict_input",
    "predict_output",
    "eval_timeout",
    "reset_optimizer",
    "restore_fallback",
    "check_numerics",
    "profile_steps",
    *CLUSTER_SETTINGS,
    "data_service",  # Where this invocation's input comes from.
    "data_service_mode",
)
# The settings that define the model or the data its checkpoints were trained on: a model_dir with
# checkpoints refuses a change (its config.yaml holds the values they were trained with). Where the
# data live (data_dir, eval_file) may change: data sets get copied to local disks. --ps_shards may
# change too: a table's checkpoint restores into another number of shards (engine.checkpointing.reshard).
MODEL_AND_DATA_SETTINGS = (
    "task",
    "task_params",
    "model",
    "dataset",
    "label_column",
    "column_types",
    "normalize",
    "vocab_size",
    "eval_fraction",
    "num_classes",
    "image_shape",
    "loss",
)
# Settings that are alternatives to each other: a config layer that sets one of them (a flag over a
# stored config.yaml, a later file over an earlier one) unsets the others it does not set itself.
ALTERNATIVE_SETTINGS = (("train_steps", "epochs"),)
# The options of the Trainer's groups (`engine.options.TRAINER_GROUPS`) that no setting holds, and why;
# every other option is the setting of its name (`trainer_options`). The job computes these.
OPTIONS_WITHOUT_SETTINGS = {
    "restore_dir": "a worker of a cluster writes to a private model_dir and restores from --model_dir",
    "steps_per_epoch": "the train split's size over --global_batch_size, for Keras callbacks' epochs",
    "flops_per_example": "counted from the model, where models.known_flops_per_example can",
}


def settings_of(values: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """`{name: values.name}`: the named settings of a RunConfig, or of parsed absl flags."""
    return {name: getattr(values, name) for name in names}


def option_setting(group: type, name: str, help: str | None = None, **options: Any) -> Any:
    """The setting that is the Trainer's option `name` of `group` (`engine.options`): the option's
    default and its help, unless the command line's differs (`help`, naming flags)."""
    return setting(default_of(group, name), help_of(group, name) if help is None else help, **options)


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    minimum: int | None = None,
    flag: bool = True,
) -> Any:
    """A `RunConfig` setting (a field of its section) and its command-line flag: `engine.cli.config.flags`
    defines `--NAME` from the default, this help and, with `choices`, as an enum that `--help` lists.
    `choices` and `minimum` (the least integer; None stays allowed) are its checks (`check_fields`).
    `flag=False`: a setting of config files and --params_override only (a mapping has no flag syntax);
    a dict default is copied for each config."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "flag": flag}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(field: dataclasses.Field) -> Any:
    """A field's default value (a fresh copy of a mutable one)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def choose(name: str, value: str, choices) -> None:
    if value not in choices:
        raise UserError(choice_message(name, value, choices))


def choice_message(name: str, value: str, choices) -> str:
    return f"unknown --{name}={value!r}; choose one of: {', '.join(choices)}"


def at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UserError(f"--{name}={value} must be at least {minimum}")


def check_numbers(section: Any) -> None:
    """Every numeric setting of a section, from the fields' types (so a new flag is covered):
    floats finite, integers within what the engine counts, timeouts within int64 ms."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
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


def check_fields(section: Any) -> None:
    """The checks a section's fields carry in their metadata: `choices` and `minimum`."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if field.metadata.get("choices") is not None:
            choose(field.name, value, field.metadata["choices"])
        if field.metadata.get("minimum") is not None and value is not None:
            at_least(field.name, value, field.metadata["minimum"])
