"""The flags that say which cluster a process is in: shared by `engine.main`
(through `engine.cli.config.flags`) and `engine.server`, resolved by `engine.cluster.resolve`.
Their defaults and help are `RunConfig` fields (`engine.cli.config.settings.CLUSTER_SETTINGS`)."""

from absl import flags

from engine.cli.config.settings import CLUSTER_SETTINGS, define_flags, settings_of

define_flags(CLUSTER_SETTINGS, module_name=__name__)

FLAGS = flags.FLAGS


def cluster_from_flags(flag_values=FLAGS):
    """The `engine.cluster.Cluster` these flags (or TF_CONFIG / Slurm) describe."""
    from engine.cluster import resolve_cluster

    return resolve_cluster(**settings_of(flag_values, CLUSTER_SETTINGS))
