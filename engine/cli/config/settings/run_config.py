"""`RunConfig`: the validated settings of one run of `engine.main`, composed of its sections
(`sections`). Flags and config files name the settings flat (`--train_steps`); the code reads
them through their section (`config.schedule.train_steps`). Imports no TensorFlow (flag parsing
and `--help` stay fast); `validate` imports the model and data packages."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from engine.cli.config.settings.fields import (
    OPTIONS_WITHOUT_SETTINGS,
    check_numbers,
)
from engine.cli.config.settings.paths import check_predict_paths
from engine.cli.config.settings.sections import (
    ClusterSettings,
    CommandSettings,
    DecisionSettings,
    DeviceSettings,
    NumericSettings,
    OptimizationSettings,
    ProblemSettings,
    ScheduleSettings,
    SpikeSettings,
    StateSettings,
    SummarySettings,
)
from engine.errors import UserError
from engine.options import TRAINER_GROUPS, options_from

# RunConfig's sections by their field names, in the order --help and docs/flags.md list them.
SECTIONS: dict[str, Any] = {  # Section classes: each with its TITLE and check()
    "devices": DeviceSettings,
    "cluster": ClusterSettings,
    "command": CommandSettings,
    "problem": ProblemSettings,
    "schedule": ScheduleSettings,
    "optimization": OptimizationSettings,
    "spikes": SpikeSettings,
    "state": StateSettings,
    "decisions": DecisionSettings,
    "summaries": SummarySettings,
    "numerics": NumericSettings,
}


@functools.cache
def setting_fields() -> tuple[dataclasses.Field, ...]:
    """Every setting (a field of a section), in the sections' order: what flags and files name."""
    return tuple(field for section in SECTIONS.values() for field in dataclasses.fields(section))


@functools.cache
def section_of() -> dict[str, str]:
    """Each setting's section: `{"train_steps": "schedule", ...}`."""
    return {field.name: key for key, section in SECTIONS.items() for field in dataclasses.fields(section)}


def flag_settings() -> tuple[str, ...]:
    """The names of the settings that are flags (every field but the config-file-only ones)."""
    return tuple(field.name for field in setting_fields() if field.metadata["flag"])


def trainer_options(config: RunConfig, **computed: Any) -> dict[str, Any]:
    """The Trainer's option groups as its keyword arguments (`{"step": StepOptions(...), ...}`),
    each option the setting of its name in `config` or, for those no setting
    holds (`OPTIONS_WITHOUT_SETTINGS`), its value in `computed` (else its default)."""
    not_computed = sorted(set(computed) - set(OPTIONS_WITHOUT_SETTINGS))
    assert not not_computed, f"{not_computed} come from the settings of their names"
    values = {**config.settings(), **computed}
    return {keyword: options_from(group, values) for keyword, group in TRAINER_GROUPS.items()}


@dataclasses.dataclass(frozen=True, init=False)
class RunConfig:
    """The settings of one run, by concern. `RunConfig(schedule=ScheduleSettings(...))`, or by the
    settings' flat names (`RunConfig(train_steps=100)`, over their sections' defaults), or both."""

    devices: DeviceSettings
    cluster: ClusterSettings
    command: CommandSettings
    problem: ProblemSettings
    schedule: ScheduleSettings
    optimization: OptimizationSettings
    spikes: SpikeSettings
    state: StateSettings
    decisions: DecisionSettings
    summaries: SummarySettings
    numerics: NumericSettings

    def __init__(self, **settings: Any) -> None:
        sections = {key: settings.pop(key, None) or section() for key, section in SECTIONS.items()}
        unknown = sorted(set(settings) - set(section_of()))
        if unknown:
            raise TypeError(f"RunConfig has no settings {unknown}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            changes.setdefault(section_of()[name], {})[name] = value
        for key, values in changes.items():
            sections[key] = dataclasses.replace(sections[key], **values)
        for key, section in sections.items():
            object.__setattr__(self, key, section)

    def __getattr__(self, name: str) -> Any:
        """A setting by its flat name (`config.train_steps`), as the flags and files spell it."""
        key = section_of().get(name)
        if key is None:
            raise AttributeError(f"RunConfig has no setting {name!r}")
        return getattr(getattr(self, key), name)

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, in the sections' order (what config.yaml holds)."""
        return {field.name: getattr(getattr(self, key), field.name) for field, key in _fields_and_keys()}

    def validate(self) -> None:
        """Raises UserError for the first bad setting: every number, then each section's own
        checks, then what crosses sections. The checks against the cluster come once it is
        resolved (`cluster.check_cluster`)."""
        self.validate_numbers()
        self.command.check()
        self._check_dry_run()  # Before the rest: what a dry run cannot check says so first.
        for key in SECTIONS:
            if key not in ("command", "state"):
                getattr(self, key).check()
        # Predict only reads the model_dir: a read-only one (a shared or archived run) will do.
        self.state.check(writable=self.command.mode != "predict")
        self._check_across()
        self._check_evaluations()

    def validate_numbers(self) -> None:
        """Every numeric setting at once: floats finite, integers within what the engine counts."""
        for key in SECTIONS:
            check_numbers(getattr(self, key))
        self.cluster.check()  # Its port: a number the launcher checks before any task starts.

    def _check_across(self) -> None:
        """What one section's setting means for another's."""
        if self.spikes.on_nonfinite == "rollback" and self.devices.strategy == "parameter_server":
            raise UserError(
                "--on_nonfinite=rollback is not supported with --strategy=parameter_server (asynchronous "
                "updates: skipping batches would not be exact); use --on_nonfinite=stop with --max_loss"
            )
        if self.cluster.data_service is not None and self.devices.strategy == "parameter_server":
            raise UserError(
                f"--data_service={self.cluster.data_service} feeds the synchronous strategies; "
                "--strategy=parameter_server builds its input on each worker (drop --data_service)"
            )
        mode = self.command.mode
        if mode in ("eval", "continuous_eval") and not self.state.model_dir:
            raise UserError(f"--mode={mode} evaluates the checkpoints of a --model_dir; pass one")
        if mode == "predict":
            check_predict_paths(self.state.model_dir, self.command.predict_input, self.command.predict_output)

    def _check_evaluations(self) -> None:
        """The decisions from eval metrics need evaluations, and a constant schedule to change."""
        for flag in self.decisions.watched("early_stop_metric", "reduce_lr_metric"):
            if self.schedule.eval_every == 0:
                raise UserError(
                    f"{flag} needs evaluations during training; set --eval_every to a positive number of steps"
                )
        needs_eval = self.decisions.watched()
        if self.command.mode == "train" and needs_eval:
            raise UserError(
                f"--mode=train runs no evaluation but {needs_eval[0]} needs one; "
                "use --mode=train_and_eval or drop it"
            )
        reduce_lr_metric, lr_schedule = self.decisions.reduce_lr_metric, self.optimization.lr_schedule
        if reduce_lr_metric is not None and lr_schedule != "constant":
            raise UserError(
                f"--reduce_lr_metric={reduce_lr_metric} changes the learning rate itself and "
                f"cannot be combined with --lr_schedule={lr_schedule}; use one of them"
            )

    def _check_dry_run(self) -> None:
        """--dry_run checks a training config on this host, as its cluster (given or simulated) would run it."""
        command, strategy = self.command, self.devices.strategy
        if not command.dry_run:
            return
        if command.dry_run_workers and strategy not in ("multi_worker_mirrored", "parameter_server"):
            raise UserError(
                f"--dry_run_workers={command.dry_run_workers} simulates a cluster's workers but --strategy="
                f"{strategy} runs on one host; use --strategy=multi_worker_mirrored or parameter_server"
            )
        if command.dry_run_ps and not (command.dry_run_workers and strategy == "parameter_server"):
            raise UserError(
                f"--dry_run_ps={command.dry_run_ps} simulates a parameter-server cluster's ps tasks; "
                "use it with --strategy=parameter_server --dry_run_workers=N"
            )
        if strategy == "tpu":
            raise UserError("--dry_run simulates CPU and GPU replicas; --strategy=tpu is checked on a TPU only")
        if command.mode in ("eval", "continuous_eval", "predict"):
            raise UserError(f"--dry_run checks a training config; drop --mode={command.mode}")

    @property
    def simulates_a_cluster(self) -> bool:
        return self.command.simulates_a_cluster

    def served_image_shape(self) -> tuple[int, int, int] | None:
        return self.problem.served_image_shape()

    def profile_window(self) -> tuple[int, int] | None:
        return self.summaries.profile_window()

    def total_steps(self, num_train_examples: int | None) -> int:
        """The steps to train to (`ScheduleSettings.total_steps`)."""
        return self.schedule.total_steps(num_train_examples, self.problem.dataset)


@functools.cache
def _fields_and_keys() -> tuple[tuple[dataclasses.Field, str], ...]:
    return tuple((field, section_of()[field.name]) for field in setting_fields())
