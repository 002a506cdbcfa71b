"""`engine.Task`: a whole problem, declared, for the command line to train.

TF Model Garden's idea in a frozen dataclass: the task says what the model,
data, loss and metrics are; `python -m engine.main --task=package.module:function`
does the rest (strategies, checkpoints, evaluation modes, export, predict) from
the same flags as the built-in image classification, which is itself a Task
made of `--model`, `--dataset`, `--loss` and `--metrics`. Any field left None
comes from those flags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras

from engine.loop.steps import EvalStep, ReplicaStep
from engine.losses import LossFn


@dataclass(frozen=True)
class Task:
    """What to train; see the README's "A task of your own".

    - `model`: `build(input_shape, num_outputs) -> keras.Model` of logits (or raw values
      for a regression), called in the strategy's scope with the data's example shape and
      the output size the labels and loss need; None: `--model`.
    - `data`: an `input.DataSource` (exact resume of a stream of any size), or
      `(train, eval)` finite `tf.data.Dataset`s of unbatched `(features, labels)` examples
      (read into memory; eval may be None), or a function returning either; None: `--dataset`.
    - `loss`: a Keras loss name (`engine.objectives`), or `loss_fn(labels, outputs)`
      returning per-example (or per-element) losses (with `num_outputs`), or such functions
      nested like a model's several outputs; None: `--loss` or the labels' default.
    - `loss_weights`: with a nested `loss`, each output's weight nested alike (`engine.losses`).
    - `metrics`: names (`engine.objectives.build_metric`) or `keras.metrics.Metric`
      objects (fed the model's outputs as they are); None: `--metrics` or the default.
    - `num_outputs`: the model's output size where `loss` is a function; None: from the labels.
    - `step_fn`, `eval_step_fn`: custom replica steps, as `engine.Trainer` takes them.
    """

    model: Callable[[tuple[int, ...], int], keras.Model] | None = None
    data: Any = None
    loss: str | LossFn | None = None
    metrics: Sequence[str | keras.metrics.Metric] | None = None
    num_outputs: int | None = None
    step_fn: ReplicaStep | None = None
    eval_step_fn: EvalStep | None = None
    loss_weights: Any = None
