"""`RunConfig`: the validated settings of one run of `engine.main`, and the one
place each setting is defined.

- `sections`: the settings by concern (devices, cluster, command, problem, schedule,
  optimization, spikes, state, decisions, summaries, numerics), each a frozen dataclass with
  its own `check`; a new setting is one field of its section;
- `fields`: how a setting is written (`setting`, `option_setting`: default, help, choices and
  least value in the field's metadata, the checks `check_fields` runs), the command line's
  choices and limits, the groups of setting names;
- `run_config`: `RunConfig` (the sections; built and read also by the settings' flat names,
  as flags and files spell them), `validate` (each section's checks, then those across
  sections), `trainer_options` (the Trainer's option groups from the settings);
- `cluster`: the cluster resolved once per command (`resolve_multi_host`, the settings' only
  look outside themselves) and the checks that need it;
- `flag_definitions`: the absl flags defined from the fields (`define_flags`);
- `paths`: the checks that look at the disk (a model_dir, predict's files).

`engine.cli.config.flags` and `engine.cli.config.cluster_flags` define the command-line
flags from the fields, and `engine.cli.config.config_files` reads the same names from config
files (`--config_file`, `--params_override`, `<model_dir>/config.yaml`). A setting named like
an option of the Trainer's groups (`engine.options`: `max_checkpoints` of `CheckpointOptions`)
is that option: it takes the option's default and, unless the command line says it otherwise,
its help (`option_setting`). Every user mistake in the flags is caught here, before anything is
written, as a `UserError` naming the bad value. Imports no TensorFlow.
"""

from engine.cli.config.settings.fields import (
    ALTERNATIVE_SETTINGS,
    CLUSTER_SETTINGS,
    COMMAND_LINE_ONLY_SETTINGS,
    DEFAULT_DEVICE_DATA_MB,
    DEFAULT_EPOCHS,
    DEFAULT_MIN_STEPS,
    DEFAULT_STEPS_PER_LOOP,
    INT32_MAX,
    INT64_MAX,
    MODEL_AND_DATA_SETTINGS,
    MULTI_HOST_STRATEGIES,
    OPTIONS_WITHOUT_SETTINGS,
    PER_INVOCATION_SETTINGS,
    PRECISION_POLICIES,
    field_default,
    settings_of,
)
from engine.cli.config.settings.flag_definitions import define_flags
from engine.cli.config.settings.paths import check_model_dir
from engine.cli.config.settings.run_config import (
    SECTIONS,
    RunConfig,
    flag_settings,
    setting_fields,
    trainer_options,
)

__all__ = [
    "ALTERNATIVE_SETTINGS",
    "CLUSTER_SETTINGS",
    "COMMAND_LINE_ONLY_SETTINGS",
    "DEFAULT_DEVICE_DATA_MB",
    "DEFAULT_EPOCHS",
    "DEFAULT_MIN_STEPS",
    "DEFAULT_STEPS_PER_LOOP",
    "INT32_MAX",
    "INT64_MAX",
    "MODEL_AND_DATA_SETTINGS",
    "MULTI_HOST_STRATEGIES",
    "OPTIONS_WITHOUT_SETTINGS",
    "PER_INVOCATION_SETTINGS",
    "PRECISION_POLICIES",
    "RunConfig",
    "SECTIONS",
    "check_model_dir",
    "define_flags",
    "field_default",
    "flag_settings",
    "setting_fields",
    "settings_of",
    "trainer_options",
]
