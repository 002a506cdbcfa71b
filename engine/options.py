"""The choices and defaults the library itself accepts, in one TF-free module.

The library (`Trainer`, strategies, schedules, hooks) and the command line
(`engine.cli.config.settings`, which builds its flags from them) share these names, so
they live below both: the library never imports the command line, and
`--help` lists them without importing TensorFlow.

The Trainer's options come in groups, frozen dataclasses it takes as keyword
arguments (`TRAINER_GROUPS`): `step=StepOptions(...)`, `cadence=Cadence(...)`,
`checkpoint=CheckpointOptions(...)`, `spikes=SpikeOptions(...)` and
`throughput=ThroughputOptions(...)`, and keeps together (`TrainerOptions`, as
`trainer.options`). Each field is one option, defined once:
its default, its help text (`help_of`: the field's `metadata["help"]`, which
the command line's flag of the same name takes where it would say the same)
and its check (a group refuses a bad value when it is made, in one line
naming it). The command line builds the same groups from its settings
(`options_from`, `engine.cli.config.settings.trainer_options`), so a new option is a
field of its group and, where the command line offers it, a flag.
"""

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, TypedDict, TypeVar

from engine.errors import UserError

SINGLE_HOST_STRATEGIES = ("default", "one_device", "mirrored")
MULTI_HOST_STRATEGIES = ("multi_worker_mirrored", "parameter_server", "tpu")
STRATEGY_NAMES = SINGLE_HOST_STRATEGIES + MULTI_HOST_STRATEGIES
# Precision name -> Keras dtype policy.
PRECISION_POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
SCHEDULE_NAMES = ("constant", "cosine", "step", "warmup_cosine")
# A NaN/Inf (or above `max_loss`) loss: stop, skip the update, or restore the last good
# checkpoint and skip the batches that led to it (engine.loop.rollback).
NONFINITE_POLICIES = ("stop", "skip", "rollback")
DEFAULT_MAX_ROLLBACKS = 3
# Each rollback restores a checkpoint and trains again from it: a run whose loss spikes at every step
# with a huge max_rollbacks would never end. A run that needs more than this has a problem to fix.
MAX_ROLLBACKS = 100
METRIC_MODES = ("auto", "min", "max")  # Whether a watched metric should go down or up.
COMMUNICATIONS = ("auto", "ring", "nccl")  # multi_worker_mirrored's collectives.
# Steps per compiled call: the Trainer's default and the CLI's (--steps_per_loop).
DEFAULT_STEPS_PER_LOOP = 50
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
DEFAULT_STARTUP_TIMEOUT = 300.0
# Seconds without a heartbeat after which a multi_worker_mirrored task counts as lost
# (TF's coordination service; its own default is 10): a frozen peer ends the run this fast.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


class StepArguments(TypedDict):
    """`StepOptions` as `engine.loop.steps.make_train_step` takes them."""

    clip_norm: float | None
    grad_accum_steps: int
    jit_compile: bool
    skip_nonfinite: bool


def option(default: Any, help: str) -> Any:
    """A field of an option group: its default and its help text (`help_of`)."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(group: type, name: str) -> str:
    """The help text of the option `name` of `group` (a class of `TRAINER_GROUPS`)."""
    return _field(group, name).metadata["help"]


def default_of(group: type, name: str) -> Any:
    """The default of the option `name` of `group`."""
    return _field(group, name).default


def _field(group: type, name: str) -> dataclasses.Field:
    fields = {field.name: field for field in dataclasses.fields(group)}
    if name not in fields:
        raise KeyError(f"{group.__name__} has no option {name!r}")
    return fields[name]


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UserError(f"`{name}={value}` must be at least {minimum}")


def _not_negative(name: str, value: float | None, meaning: str) -> None:
    """`value` is None or a finite number >= 0 (`meaning` says what None and 0 mean)."""
    if value is not None and not 0 <= value < math.inf:  # Also refuses NaN.
        raise UserError(f"`{name}={value}` must not be negative ({meaning})")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the standard step turns a batch into an update. A `step_fn` replaces that
    step, so the Trainer refuses any of these that differs from its default."""

    clip_norm: float | None = option(None, "Clip the global (all-reduced) gradient norm to this value.")
    grad_accum_steps: int = option(
        1,
        "Split each replica's batch into this many micro-batches and accumulate their gradients "
        "(summed before one update).",
    )
    jit_compile: bool = option(False, "Compile the per-replica step (forward and backward pass) with XLA.")
    on_nonfinite: str = option(
        "stop",
        "A step whose loss or gradient is NaN/Inf (or whose loss is above max_loss): stop the run saving "
        "nothing, skip its update, or roll back: restore the last good checkpoint and skip the batches "
        "that led to it (engine.loop.rollback). One of: " + ", ".join(NONFINITE_POLICIES) + ".",
    )

    def __post_init__(self) -> None:
        if self.clip_norm is not None and not 0 < self.clip_norm < math.inf:  # Also refuses NaN.
            raise UserError(f"`clip_norm={self.clip_norm}` must be positive and finite (None: no clipping)")
        _at_least("grad_accum_steps", self.grad_accum_steps, 1)
        if self.on_nonfinite not in NONFINITE_POLICIES:
            choices = ", ".join(NONFINITE_POLICIES)
            raise UserError(f"`on_nonfinite={self.on_nonfinite!r}` must be one of: {choices}")

    def step_arguments(self) -> StepArguments:
        return StepArguments(
            clip_norm=self.clip_norm,
            grad_accum_steps=self.grad_accum_steps,
            jit_compile=self.jit_compile,
            skip_nonfinite=self.on_nonfinite == "skip",
        )

    def changed(self) -> list[str]:
        """`name=value` of each option that is not its default and shapes the step: "rollback"
        acts between loops (like "stop"), so a `step_fn` may have it."""
        default = StepOptions()
        return [
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(default, field.name)
            and (field.name, getattr(self, field.name)) != ("on_nonfinite", "rollback")
        ]


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When things happen between compiled calls, in global steps (None or 0: never).

    The outer loop asks it how long the next compiled call may run, so that
    no call runs past an evaluation, a checkpoint or the target step, and
    whether an evaluation or a checkpoint is due after a call. A 0 is kept as
    None: `Cadence(eval_every=0) == Cadence()`.
    """

    steps_per_loop: int = option(
        DEFAULT_STEPS_PER_LOOP,
        "The most steps one compiled call runs; loops are cut shorter at evaluations, checkpoints, progress "
        "lines and where a callback asks.",
    )
    eval_every: int | None = option(
        None, "Evaluate every N steps during train(); None or 0: no evaluation there (call evaluate())."
    )
    checkpoint_every: int | None = option(
        None, "Save a checkpoint every N steps; train() also saves at its end. None or 0: only at the end."
    )
    log_every: int | None = option(
        None, "A progress line every N steps (loops are cut to match); None or 0: one after every loop."
    )
    steps_per_epoch: int | None = option(
        None,
        "Steps of one epoch, for Keras callbacks (engine.callbacks.keras_adapter), which act at epoch ends: "
        "loops are cut there. None: no epochs (Keras callbacks are refused).",
    )

    def __post_init__(self) -> None:
        _at_least("steps_per_loop", self.steps_per_loop, 1)
        for name, meaning in (
            ("eval_every", "None or 0: no evaluation during train()"),
            ("checkpoint_every", "None or 0: only at the end of train()"),
            ("log_every", "0 logs after every loop"),
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"`{name}={value}` must not be negative ({meaning})")
            object.__setattr__(self, name, value or None)  # 0 is None: never.
        if self.steps_per_epoch is not None:
            _at_least("steps_per_epoch", self.steps_per_epoch, 1)

    def loop_length(self, start: int, target: int) -> int:
        """Steps the call starting at `start` may run toward `target`."""
        length = min(self.steps_per_loop, target - start)
        for every in (self.eval_every, self.checkpoint_every):
            if every:
                length = min(length, every - start % every)
        return length

    def evaluates_after(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0)

    def checkpoints_after(self, step: int) -> bool:
        return bool(self.checkpoint_every and step % self.checkpoint_every == 0)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """What the Checkpointer keeps, how it restores and how it writes."""

    max_checkpoints: int = option(
        3, "Checkpoints to keep in <model_dir>/checkpoints: the newest N; older ones are deleted."
    )
    restore_fallback: bool = option(
        False,
        "If the latest checkpoint cannot be read, restore the newest older one that can "
        "(the unreadable one is moved to checkpoints/unreadable/).",
    )
    restore_dir: str | None = option(
        None,
        "Restore from this model_dir instead of the one written (a non-chief worker writes to a private "
        "model_dir but resumes from the chief's).",
    )
    reset_optimizer: bool = option(
        False,
        "Restore the weights and the step of the checkpoints with fresh optimizer state, so that the "
        "optimizer may change.",
    )
    async_checkpoint: bool = option(
        True,
        "Write checkpoints in the background: a save waits only for a copy of the variables in memory, "
        "and the checkpoint state file names a checkpoint once its files are complete. Off (synchronous) "
        "under the multi_worker_mirrored, parameter_server and tpu strategies, where it is not verified.",
    )

    def __post_init__(self) -> None:
        _at_least("max_checkpoints", self.max_checkpoints, 1)


@dataclasses.dataclass(frozen=True)
class SpikeOptions:
    """What counts as a loss spike besides a NaN/Inf, and how `on_nonfinite="rollback"` recovers.

    A step is a spike when its loss or gradient is not finite, or its loss (the step's
    "loss" output, averaged over replicas) is above `max_loss`. `rollback_skip_batches`
    more batches than those since the restored checkpoint are skipped (engine.loop.rollback);
    after `max_rollbacks` rollbacks the next spike stops the run.
    """

    max_loss: float | None = option(
        None, 'A finite loss above this is a spike too: on_nonfinite="stop" stops, "rollback" rolls back.'
    )
    rollback_skip_batches: int = option(
        0,
        'With on_nonfinite="rollback": skip this many batches more than those from the restored checkpoint '
        "up to and including the spike's.",
    )
    max_rollbacks: int = option(
        DEFAULT_MAX_ROLLBACKS,
        f'With on_nonfinite="rollback": after this many rollbacks (at most {MAX_ROLLBACKS}) the next spike '
        "stops the run (nothing saved).",
    )

    def __post_init__(self) -> None:
        if self.max_loss is not None and not (self.max_loss > 0 and self.max_loss < float("inf")):
            raise UserError(f"`max_loss={self.max_loss}` must be a positive, finite loss")
        if self.rollback_skip_batches < 0:
            raise UserError(f"`rollback_skip_batches={self.rollback_skip_batches}` must be >= 0")
        _at_least("max_rollbacks", self.max_rollbacks, 1)
        if self.max_rollbacks > MAX_ROLLBACKS:
            raise UserError(
                f"`max_rollbacks={self.max_rollbacks}` must be at most {MAX_ROLLBACKS} (each rollback trains "
                "again from a checkpoint; a run that spikes that often needs a lower learning rate or clipping)"
            )

    def problem(self, on_nonfinite: str) -> str | None:
        """What is wrong with these options under `on_nonfinite`, in the library's terms; None: fine
        (each option on its own was checked when the group was made)."""
        if self.max_loss is not None and on_nonfinite == "skip":
            return (
                f"`max_loss={self.max_loss}` stops or rolls back on a spike; it cannot skip the update "
                "(the step has applied it when the loop sees the loss): pass `on_nonfinite='stop'` or "
                "`on_nonfinite='rollback'`"
            )
        return None


@dataclasses.dataclass(frozen=True)
class ThroughputOptions:
    """What the progress lines and TensorBoard need to show the training TFLOP/s and MFU, and
    which worker of a synchronous cluster is slow."""

    flops_per_example: int | None = option(
        None,
        "The model's forward-pass FLOPs per example (e.g. models.flops_per_example(model)): the logs then "
        "show the training TFLOP/s (3x forward). None or 0: unknown, not shown.",
    )
    peak_tflops: float | None = option(
        None,
        "The devices' peak TFLOP/s (all replicas together, at the compute precision): with "
        "flops_per_example the logs then show MFU, the training TFLOP/s over it. None or 0: unknown.",
    )

    straggler_margin: float = option(
        1.5,
        "multi_worker_mirrored with the standard step: name a worker whose compute time per step (its "
        "step until its gradients, before the all-reduce) is this many times the median of the others' "
        "(engine.stragglers); 0: no report and no timing in the step.",
    )
    straggler_loops: int = option(
        5, "For this many loops in a row before it is named (once, until it recovers)."
    )

    def __post_init__(self) -> None:
        _not_negative("flops_per_example", self.flops_per_example, "None or 0: unknown")
        _not_negative("peak_tflops", self.peak_tflops, "None or 0: unknown")
        if not (self.straggler_margin == 0 or 1 < self.straggler_margin < math.inf):
            raise UserError(
                f"`straggler_margin={self.straggler_margin}` must be above 1, e.g. 1.5 (0: no report)"
            )
        if self.straggler_loops < 1:
            raise UserError(f"`straggler_loops={self.straggler_loops}` must be at least 1")


DATA_SERVICE_MODES = ("parallel_epochs", "distributed_epoch")  # tf.data service processing modes.


@dataclasses.dataclass(frozen=True)
class DataService:
    """Where the training input is produced: a tf.data service dispatcher (`python -m engine.data_service`,
    `tf.data.experimental.service`), whose data workers run the input pipeline on other cores or hosts.

    An option of the data forms (`engine.GlobalBatches(..., service=)`, `engine.PerReplicaBatches(...,
    service=)`): each input pipeline, positioned at the step the run starts from, is sent to the service
    and its batches read back (`docs/several-machines.md`, "When the input is the bottleneck").
    """

    address: str = option("", "The dispatcher, grpc://HOST:PORT (or HOST:PORT).")
    processing_mode: str = option(
        "parallel_epochs",
        "parallel_epochs: every data worker runs the whole pipeline (one worker: the batches of local input, "
        "in order); distributed_epoch: the dispatcher splits the pipeline's source among the workers, each "
        "element at most once per epoch, in the order the workers answer.",
    )
    job_name: str | None = option(
        None,
        "Input pipelines (of several hosts) that name the same job share one stream, each batch going to one "
        "of them; None: every pipeline reads a stream of its own.",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not _service_address_ok(self.address):
            raise UserError(
                f"DataService(address={self.address!r}) must be a dispatcher's grpc://HOST:PORT "
                "(python -m engine.data_service --dispatcher prints it)"
            )
        if self.processing_mode not in DATA_SERVICE_MODES:
            raise UserError(
                f"DataService(processing_mode={self.processing_mode!r}) must be one of: "
                + ", ".join(DATA_SERVICE_MODES)
            )
        if self.job_name is not None and (not isinstance(self.job_name, str) or not self.job_name.strip()):
            raise UserError(f"DataService(job_name={self.job_name!r}) must be a non-empty name or None")

    @property
    def target(self) -> str:
        """The address as tf.data's `service=` takes it, with its protocol."""
        return self.address if "://" in self.address else f"grpc://{self.address}"

    def describe(self) -> str:
        """Where the input comes from, for the banner and the log."""
        job = "" if self.job_name is None else f", job {self.job_name}"
        return f"tf.data service at {self.target} ({self.processing_mode}{job})"


def _service_address_ok(address: str) -> bool:
    """grpc://HOST:PORT or HOST:PORT, the port a number in 1-65535."""
    rest = address[len("grpc://") :] if address.startswith("grpc://") else address
    host, _, port = rest.rpartition(":")
    return bool(host) and "/" not in rest and port.isdigit() and 1 <= int(port) <= 65535


# The Trainer's keyword argument of each option group, in its signature's order.
TRAINER_GROUPS: dict[str, type] = {
    "step": StepOptions,
    "cadence": Cadence,
    "checkpoint": CheckpointOptions,
    "spikes": SpikeOptions,
    "throughput": ThroughputOptions,
}

# The flat keywords the Trainer took before its option groups, each the option of its name: taken for
# one more release through `group_options` (which the Trainer runs, with a warning), in no signature.
# An option added to a group since has no flat spelling.
FLAT_ALIASES: frozenset[str] = frozenset(
    {
        *("clip_norm", "grad_accum_steps", "jit_compile", "on_nonfinite"),
        *("steps_per_loop", "eval_every", "checkpoint_every", "log_every", "steps_per_epoch"),
        *("max_checkpoints", "restore_fallback", "restore_dir", "reset_optimizer", "async_checkpoint"),
        *("max_loss", "rollback_skip_batches", "max_rollbacks"),
        *("flops_per_example", "peak_tflops"),
    }
)


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The option groups a Trainer runs with (`trainer.options`), under the names of its keywords:
    apart from `trainer.step` (the global step) and `trainer.checkpoint` (what a checkpoint holds)."""

    step: StepOptions = dataclasses.field(default_factory=StepOptions)
    cadence: Cadence = dataclasses.field(default_factory=Cadence)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    spikes: SpikeOptions = dataclasses.field(default_factory=SpikeOptions)
    throughput: ThroughputOptions = dataclasses.field(default_factory=ThroughputOptions)

    @classmethod
    def of(cls, **groups: Any) -> "TrainerOptions":
        """The Trainer's keywords `step=`, `cadence=`, ... (None: that group's defaults)."""
        return cls(**{keyword: group for keyword, group in groups.items() if group is not None})


def group_of(alias: str) -> str:
    """Where the flat keyword `alias` goes: `steps_per_loop=` is `cadence=Cadence(steps_per_loop=...)`."""
    for keyword, group in TRAINER_GROUPS.items():
        if alias in {field.name for field in dataclasses.fields(group)}:
            return f"{keyword}=engine.{group.__name__}({alias}=...)"
    raise KeyError(alias)


Group = TypeVar("Group")


def options_from(group: type[Group], values: Mapping[str, Any]) -> Group:
    """`group` made from `values` (option name -> value): each of its options that `values`
    names takes that value, the others their defaults; names of other options are ignored."""
    fields = dataclasses.fields(group)  # type: ignore[arg-type]
    return group(**{field.name: values[field.name] for field in fields if field.name in values})


def group_options(arguments: Mapping[str, Any], aliases: Collection[str] = FLAT_ALIASES) -> dict[str, Any]:
    """Keyword arguments with the flat `aliases` of the option groups (`clip_norm=` for
    `step=StepOptions(clip_norm=)`) made into their groups (`TRAINER_GROUPS`). A group
    given together with one of its aliases is refused in one line naming both."""
    arguments = dict(arguments)
    for keyword, group in TRAINER_GROUPS.items():
        flat = {
            field.name: arguments.pop(field.name)
            for field in dataclasses.fields(group)
            if field.name in aliases and field.name in arguments
        }
        if not flat:
            continue
        if arguments.get(keyword) is not None:
            name = next(iter(flat))
            raise UserError(
                f"`{keyword}={group.__name__}(...)` and its flat alias `{name}={flat[name]!r}` were both "
                f"given; pass `{name}` in the group, or only flat names"
            )
        arguments[keyword] = group(**flat)
    return arguments
