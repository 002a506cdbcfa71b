"""The cluster concern: which cluster a process is in, how its tasks start,
and the multi-host strategies.

- `resolve`: the cluster from arguments, TF_CONFIG or Slurm (pure Python).
- `multi_host`: MultiWorkerMirrored / ParameterServer / TPU strategies and the bounded start-up.
- `startup_watchdog`: the start-up watchdog, run by path by `multi_host`.

The processes of a cluster (`python -m engine.launch`, `python -m engine.server`) and the
cluster flags are the command line's: `engine.cli.launcher`, `engine.cli.task_server`,
`engine.cli.cluster_flags`.

Importing this package imports only `resolve` (no TensorFlow, no flags).
"""

from engine.cluster.resolve import (
    DEFAULT_SLURM_PORT_BASE,
    RESOLVERS,
    TASK_TYPES,
    Cluster,
    check_strategy_cluster,
    resolve_cluster,
    security_warning,
    task_model_dir,
)

__all__ = [
    "DEFAULT_SLURM_PORT_BASE",
    "RESOLVERS",
    "TASK_TYPES",
    "Cluster",
    "check_strategy_cluster",
    "resolve_cluster",
    "security_warning",
    "task_model_dir",
]
