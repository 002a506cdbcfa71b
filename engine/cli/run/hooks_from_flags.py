"""The built-in hooks a `RunConfig` (the command-line flags) asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.callbacks import Callback
from engine.hooks.best_checkpoint import BestCheckpoint
from engine.hooks.early_stopping import EarlyStopping
from engine.hooks.graph import TrainGraph
from engine.hooks.histograms import WeightHistograms
from engine.hooks.plateau import ReduceLROnPlateau
from engine.hooks.profiler import ProfileWindow

if TYPE_CHECKING:
    from engine.cli.config.settings import RunConfig


def hooks_from_config(config: RunConfig) -> list[Callback]:
    hooks: list[Callback] = [TrainGraph()]
    window = config.profile_window()
    if window is not None:
        hooks.append(ProfileWindow(*window))
    if config.histogram_every:
        hooks.append(WeightHistograms(config.histogram_every))
    if config.best_checkpoint_metric:
        hooks.append(BestCheckpoint(config.best_checkpoint_metric))
    if config.reduce_lr_metric:
        hooks.append(
            ReduceLROnPlateau(
                config.reduce_lr_metric,
                patience=config.reduce_lr_patience,
                factor=config.reduce_lr_factor,
                min_rate=config.min_learning_rate,
            )
        )
    if config.early_stop_metric:  # Last: the others still see the evaluation that stops training.
        hooks.append(
            EarlyStopping(
                config.early_stop_metric, patience=config.early_stop_patience, mode=config.early_stop_mode
            )
        )
    return hooks
