"""Metric results as log scalars: one float per log key, vector-valued metrics per entry.

A Keras metric's `result()` may be a vector: `F1Score()` (`average=None`) gives one value
per class, `Precision(thresholds=[...])` one per threshold. Progress lines, TensorBoard,
metrics.json and callbacks all take one scalar per key, so each entry gets its own key,
`<name>/<index>` (`f1_score/0`, `f1_score/1`, ...; `<name>/<i>_<j>` for a matrix), rather
than crashing the loop after its updates were applied. A metric whose result is a dict
gets `<name>/<key>` likewise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf


def metric_logs(metrics: Iterable[Any]) -> dict[str, float]:
    """`{key: float}` of every metric's current result (see the module's docstring)."""
    logs: dict[str, float] = {}
    for metric in metrics:
        logs.update(log_scalars(metric.name, metric.result()))
    return logs


def log_scalars(name: str, value: Any) -> dict[str, float]:
    """`value` (a scalar, an array of any rank, or a dict of them) as floats keyed from `name`."""
    if isinstance(value, Mapping):
        scalars: dict[str, float] = {}
        for key, item in value.items():
            scalars.update(log_scalars(f"{name}/{key}", item))
        return scalars
    if isinstance(value, (int, float)):  # A Python number as it is (through float32 0.8 would read 0.800000011).
        return {name: float(value)}
    array = np.asarray(tf.convert_to_tensor(value))
    if array.ndim == 0:
        return {name: float(array)}
    return {f"{name}/{'_'.join(map(str, index))}": float(array[index]) for index in np.ndindex(array.shape)}
