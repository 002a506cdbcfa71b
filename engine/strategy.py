"""Builds the `tf.distribute.Strategy` a run asks for.

Several replicas on a machine without GPUs come from splitting the host CPU
into logical devices, which TensorFlow allows only before its runtime starts:
`configure_cpu_devices` must run before anything touches a device.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import tensorflow as tf

from engine.compat import give_collective_group
from engine.errors import UserError
from engine.logger import logger
from engine.options import MULTI_HOST_STRATEGIES, STRATEGY_NAMES

if TYPE_CHECKING:
    from engine.cluster.multi_host import MultiHostOptions


def configure_cpu_devices(cpu_devices: int) -> None:
    """Splits the first physical CPU into `cpu_devices` logical devices (idempotent)."""
    if cpu_devices < 1:
        raise UserError(f"`cpu_devices={cpu_devices}` must be at least 1")
    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is not None and len(existing) == cpu_devices:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= cpu_devices:
            return  # Already split into enough devices; use the first `cpu_devices`.
        raise UserError(
            f"`cpu_devices={cpu_devices}` cannot be applied: TensorFlow already started "
            f"with {have} CPU device(s); split the CPU before any TensorFlow work"
        ) from None


def build_strategy(
    strategy: str = "default",
    *,
    cpu_devices: int = 1,
    num_gpus: int | None = None,
    multi_host: MultiHostOptions | None = None,
) -> tf.distribute.Strategy:
    """Returns the strategy called `strategy`.

    `mirrored` uses `num_gpus` GPUs (all visible ones when None) and, when
    there are none, `cpu_devices` logical CPU devices, so several replicas
    can be used and tested on a laptop. The multi-host strategies take their
    cluster, communication and TPU settings from `multi_host`
    (`engine.cluster.multi_host.MultiHostOptions`).

    Args:
      strategy: one of `STRATEGY_NAMES` (default, one_device, mirrored,
        multi_worker_mirrored, parameter_server, tpu).
      cpu_devices: logical CPU devices `mirrored` uses as replicas without
        GPUs (split them first with `configure_cpu_devices`).
      num_gpus: GPUs for mirrored/one_device; None uses every visible one.
      multi_host: cluster settings for the multi-host strategies.

    Returns:
      The `tf.distribute.Strategy`; create the model and optimizer in its `scope()`.

    Raises:
      UserError: an unknown name or an impossible device request, named.
    """
    if strategy not in STRATEGY_NAMES:
        raise UserError(f"unknown `strategy={strategy!r}`; choose one of: {', '.join(STRATEGY_NAMES)}")
    if cpu_devices < 1:
        raise UserError(f"`cpu_devices={cpu_devices}` must be at least 1")
    if num_gpus is not None and num_gpus < 0:
        raise UserError(f"`num_gpus={num_gpus}` must be at least 0 (None: every visible GPU)")
    if strategy in MULTI_HOST_STRATEGIES:
        from engine.cluster.multi_host import MultiHostOptions, build_multi_host_strategy

        return build_multi_host_strategy(strategy, multi_host or MultiHostOptions())
    if strategy == "default":
        return tf.distribute.get_strategy()
    if cpu_devices > 1:
        configure_cpu_devices(cpu_devices)
    gpus = tf.config.list_logical_devices("GPU")
    if num_gpus is not None:
        if num_gpus > len(gpus):
            raise UserError(
                f"`num_gpus={num_gpus}` but only {len(gpus)} GPU(s) are visible; "
                "lower `num_gpus` or use `cpu_devices` on a CPU-only machine"
            )
        gpus = gpus[:num_gpus]
    if strategy == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if gpus:
        return _mirrored([gpu.name for gpu in gpus])
    devices = [f"/cpu:{index}" for index in range(cpu_devices)]
    return _mirrored(devices)


_MIRRORED: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}
# The collective group keys the engine gives MirroredStrategies, far above the ones every
# MirroredStrategy starts from (1), a thousand apart (a strategy takes one key per device set).
_GROUP_KEYS = itertools.count(start=1_000_000, step=1_000)
# The strategies that hold keys of their own (`own_collectives`): keyed once, before the engine traces.
_KEYED: weakref.WeakSet = weakref.WeakSet()


def own_collectives(strategy: tf.distribute.Strategy) -> None:
    """Gives a MirroredStrategy collective keys no other strategy of the process uses, once.

    Two MirroredStrategy objects in one process (two made by hand, or one used by Keras `fit`
    and another by the engine) would otherwise pair their all-reduces and abort every later
    collective ("Shape mismatch in the collective instance", `engine.compat.give_collective_group`).
    The Trainer calls it for the strategy it is given, `build_strategy` for the ones it makes;
    `build_strategy("mirrored")` still returns one strategy per device list and process.
    """
    if not isinstance(strategy, tf.distribute.MirroredStrategy) or strategy in _KEYED:
        return
    if not give_collective_group(strategy, next(_GROUP_KEYS)):
        logger.info(
            "%s has its own cross_device_ops: its collective keys are left as they are",
            type(strategy).__name__,
        )
    _KEYED.add(strategy)


def _mirrored(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy per device list and process.

    Every MirroredStrategy numbers its collective ops from the same start,
    so a second one over the same devices can pair its all-reduces with
    those of the first one's programs ("Shape mismatch in the collective
    instance ...") and abort every later collective in the process. A
    notebook or test that asks twice gets the same strategy back.
    """
    key = tuple(devices)
    if key not in _MIRRORED:
        _MIRRORED[key] = tf.distribute.MirroredStrategy(devices)
        own_collectives(_MIRRORED[key])
    return _MIRRORED[key]
