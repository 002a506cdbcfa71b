"""What the command line trains for: the loss and metrics of its classification task.

One definition for the training job and the checkpoint evaluator, so that
`--mode=eval` reports the same numbers as the evaluation inside training.
"""

from __future__ import annotations

from typing import Any

import keras


def classification_task() -> dict[str, Any]:
    """`loss_fn` and `metrics`, as `engine.Trainer` takes them: cross-entropy of integer
    labels against logits, per example (the engine averages), and accuracy."""
    return {
        "loss_fn": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    }
