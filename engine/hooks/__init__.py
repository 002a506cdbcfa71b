"""Built-in hooks (callbacks) for `Trainer(callbacks=...)`; `from_config`
builds them from the command-line flags."""

from engine.hooks.best_checkpoint import BestCheckpoint
from engine.hooks.early_stopping import EarlyStopping
from engine.hooks.graph import TrainGraph
from engine.hooks.histograms import WeightHistograms
from engine.hooks.plateau import ReduceLROnPlateau
from engine.hooks.profiler import ProfileWindow

__all__ = [
    "BestCheckpoint",
    "EarlyStopping",
    "ProfileWindow",
    "ReduceLROnPlateau",
    "TrainGraph",
    "WeightHistograms",
]
