"""Every command-line flag of `python -m engine.main`, and nothing else.

Each flag is a `RunConfig` field (`engine/cli/config/settings/` holds its default, help and
choices); this module only says which ones `engine.main` defines. Names with a
fixed set of values are enums that `--help` lists; models and datasets stay
strings (`--model` also takes package.module:function), checked by `RunConfig`.
"""

from absl import flags

from engine.cli.config import cluster_flags  # noqa: F401  (--worker_hosts, --ps_hosts, --task_type, ...)
from engine.cli.config.settings import CLUSTER_SETTINGS, define_flags, flag_settings

# Settings without a flag (task_params) come only from config files (engine.cli.config.config_files).
define_flags([name for name in flag_settings() if name not in CLUSTER_SETTINGS], module_name=__name__)

FLAGS = flags.FLAGS
