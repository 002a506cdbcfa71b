"""The built-in hooks the command-line flags ask for: their decisions and summaries sections."""

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
    from engine.cli.config.settings.sections import DecisionSettings, SummarySettings


def hooks_from_config(decisions: DecisionSettings, summaries: SummarySettings) -> list[Callback]:
    """`RunConfig.decisions` and `.summaries` as the hooks that act on them."""
    hooks: list[Callback] = [TrainGraph()]
    window = summaries.profile_window()
    if window is not None:
        hooks.append(ProfileWindow(*window))
    if summaries.histogram_every:
        hooks.append(WeightHistograms(summaries.histogram_every))
    if decisions.best_checkpoint_metric:
        hooks.append(BestCheckpoint(decisions.best_checkpoint_metric))
    if decisions.reduce_lr_metric:
        hooks.append(
            ReduceLROnPlateau(
                decisions.reduce_lr_metric,
                patience=decisions.reduce_lr_patience,
                factor=decisions.reduce_lr_factor,
                min_rate=decisions.min_learning_rate,
            )
        )
    if decisions.early_stop_metric:  # Last: the others still see the evaluation that stops training.
        hooks.append(
            EarlyStopping(
                decisions.early_stop_metric,
                patience=decisions.early_stop_patience,
                mode=decisions.early_stop_mode,
            )
        )
    return hooks
