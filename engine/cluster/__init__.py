"""The cluster concern, as a library: which cluster a process is in, the multi-host
strategies, and what a lost peer looks like.

- `resolve`: the cluster from arguments, TF_CONFIG or Slurm (pure Python).
- `multi_host`: MultiWorkerMirrored / ParameterServer / TPU strategies and the bounded start-up.
- `startup_watchdog`: the start-up watchdog, run by path by `multi_host`.
- `peer_loss`: a peer that stopped answering mid-run, as one line instead of a traceback.

Starting the processes of a cluster (`python -m engine.launch`, `python -m engine.server`,
the multi-host rendezvous) is the launcher's: the `engine.launch` package. The cluster
flags are the command line's: `engine.cli.config.cluster_flags`.

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
