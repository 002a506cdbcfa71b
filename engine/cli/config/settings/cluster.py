"""The cluster a command runs in, resolved once (`resolve_multi_host`: the settings' one look
outside themselves, at the cluster flags, TF_CONFIG or Slurm's variables) into a frozen
`MultiHostOptions` that `engine.cli.main_command` passes down to the run; and the checks that
need it (`check_cluster`). Imports no TensorFlow."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine.cli.config.settings.fields import CLUSTER_SETTINGS, settings_of
from engine.cluster.resolve import check_strategy_cluster
from engine.errors import UserError

if TYPE_CHECKING:
    from engine.cli.config.settings.run_config import RunConfig
    from engine.cluster.multi_host import MultiHostOptions


def resolve_multi_host(config: RunConfig) -> MultiHostOptions:
    """The cluster (from the flags, TF_CONFIG or Slurm) and the multi-host settings; no cluster
    for the single-host strategies unless flags name one."""
    from engine.cli.process.preemption import signals_left_pending
    from engine.cluster import resolve_cluster
    from engine.cluster.multi_host import MultiHostOptions

    devices, model_dir = config.devices, config.state.model_dir
    cluster = None
    if devices.strategy in ("multi_worker_mirrored", "parameter_server") or config.cluster.names_a_cluster:
        cluster = resolve_cluster(**settings_of(config.cluster, CLUSTER_SETTINGS))
    return MultiHostOptions(
        cluster=cluster,
        communication=devices.communication,
        collective_timeout=devices.collective_timeout,
        tpu=devices.tpu,
        startup_timeout=devices.startup_timeout,
        heartbeat_timeout=devices.heartbeat_timeout,
        startup_guard=signals_left_pending,
        # A start-up that times out reports where it waited (engine.diagnostics.DIAGNOSTICS_DIR).
        diagnostics_dir=os.path.join(model_dir, "diagnostics") if model_dir else None,
    )


def check_cluster(config: RunConfig, multi_host: MultiHostOptions) -> None:
    """The settings against the cluster resolved: a dry run simulates one or checks the one given,
    never both; a real one must suit --strategy (`MultiHostOptions.check`)."""
    command, strategy, cluster = config.command, config.devices.strategy, multi_host.cluster
    if command.dry_run and strategy == "parameter_server" and not command.dry_run_workers and cluster is None:
        raise UserError(
            "--dry_run --strategy=parameter_server simulates a cluster: pass --dry_run_workers=N (and "
            "--dry_run_ps=M), or the cluster's flags or TF_CONFIG as its chief is given them"
        )
    if command.simulates_a_cluster:  # A simulated cluster has no hosts to resolve.
        if cluster is not None:
            raise UserError(
                f"--dry_run_workers={command.dry_run_workers} simulates a cluster but one is given (the cluster "
                "flags or TF_CONFIG); drop one of them"
            )
        return
    check_strategy_cluster(strategy, cluster)  # Its other settings: DeviceSettings.check.
