"""The Trainer for parameter-server training, run on the chief (the coordinator).

The same outer loop as `engine.trainer.trainer.Trainer`, with the runners of
`engine.loop.ps_runners`: training scheduled on the workers in closures, evaluation
and prediction on the coordinator. It lives beside the Trainer, above the loop, so
that no module of `engine.loop` imports the Trainer.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from engine.data import Data, DataForm, as_train_form
from engine.errors import UserError
from engine.loop.ps_runners import CoordinatedTrainRunner, CoordinatorEvalRunner, CoordinatorPredictRunner
from engine.loop.runners import EvalRunner, PredictRunner, TrainRunner
from engine.losses import Objective
from engine.resident import ResidentData, ResidentEvalData
from engine.trainer.trainer import Trainer


class CoordinatedTrainer(Trainer):
    """A `Trainer` for `ParameterServerStrategy`, to be run on the chief: the same outer
    loop, with runners that schedule training on the workers and evaluate on the chief."""

    def __init__(self, *, strategy: tf.distribute.Strategy, train_data: Data, **kwargs: Any):
        if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise UserError(f"CoordinatedTrainer needs a ParameterServerStrategy, got {type(strategy).__name__}")
        host_data = train_data.host_data if isinstance(train_data, ResidentData) else train_data
        if as_train_form(host_data).service is not None:
            raise UserError(
                "parameter-server training builds its input on each worker: the tf.data service "
                "(service=) is for the synchronous strategies; pass train_data without it"
            )
        if getattr(as_train_form(host_data), "dataset", None) is not None:
            raise UserError(
                "parameter-server training builds its input on each worker: pass train_data as "
                "fn(input_context, start_step) or fn(start_step), not a tf.data.Dataset"
            )
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        super().__init__(strategy=strategy, train_data=train_data, **kwargs)

    def _make_train_runner(self, data: DataForm | ResidentData, global_batch_size: int) -> TrainRunner:
        assert not isinstance(data, ResidentData), "ResidentData trains from its host_data here"
        return CoordinatedTrainRunner(
            self.coordinator,
            self.replica_step,
            self.global_step,
            data,
            global_batch_size=global_batch_size,
            max_loss=self.spike_options.max_loss,
        )

    def _make_predict_runner(self) -> PredictRunner:
        return CoordinatorPredictRunner(self.strategy, self.model)

    def _make_eval_runner(
        self, objective: Objective, data: DataForm | ResidentEvalData, **options: Any
    ) -> EvalRunner:
        assert not isinstance(data, ResidentEvalData), "ResidentEvalData evaluates from its host_data here"
        return CoordinatorEvalRunner(
            self.strategy, self.model, objective, data, batches_per_call=self.cadence.steps_per_loop, **options
        )
