"""The outer loop: when to train, evaluate, save, log and stop.

The Trainer decides how many steps the next compiled call runs (never
past the next evaluation, checkpoint or the target step: `Cadence`) and
what happens between calls. What one call does is the runners'
(`engine.loop.runners`: a `TrainRunner`, an `EvalRunner`), saving and
restoring the `Checkpointer`'s (`engine.checkpointing.checkpointer`), the compiled
functions `engine.loop.compiled`'s. Everything here runs once per loop, not per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import keras
import tensorflow as tf

from engine.callbacks import Callback, CallbackLike, as_callbacks
from engine.callbacks.progress import Progress, format_logs
from engine.checkpointing import discovery
from engine.checkpointing.background import writes_in_background
from engine.checkpointing.checkpointer import Checkpointer, checkpoint_of
from engine.compat import custom_gradient_names, forget_custom_gradients
from engine.data import Data, DataForm, DataPosition
from engine.ema import WeightAverages, averages_swapped_in, weight_averages
from engine.errors import DataExhaustedError, NonFiniteLossError, UserError
from engine.goodput import GoodputClock, ModelFlops, TimedFunction, breakdown_line, scalars
from engine.keras_model import (
    KerasEvalRunner,
    KerasTrainStep,
    build_compiled_state,
    keras_arguments,
    label_and_output_shapes,
    loss_beyond_keras,
    metrics_result_or_logs,
)
from engine.logger import logger, message_width, wrap_line
from engine.loop.replica_state import replica_local_state
from engine.loop.rollback import CHECKPOINT_KEY, Rollback, Spike, check_options, holds_position, stop_message
from engine.loop.runners import EvalRunner, PredictRunner, TrainRunner, as_prediction_batches, fresh_copy
from engine.loop.steps import STEP_EXAMPLES, EvalStep, ReplicaStep, make_train_step
from engine.loop.variable_length import one_step_per_call
from engine.losses import LossFn, Objective
from engine.metric_values import metric_logs
from engine.options import (
    FLAT_ALIASES,
    Cadence,
    CheckpointOptions,
    SpikeOptions,
    StepOptions,
    ThroughputOptions,
    TrainerOptions,
    group_of,
    group_options,
)
from engine.precision import with_loss_scaling
from engine.resident import (
    ResidentData,
    ResidentEvalData,
    arrays_as_eval_data,
    arrays_as_train_data,
    host_form_of,
)
from engine.schedules import is_scheduled
from engine.stopping import StopAgreement
from engine.stragglers import StragglerReport
from engine.strategy import own_collectives
from engine.summaries import SummaryWriters
from engine.trainer.checks import (
    Optimizers,
    check_arguments,
    eval_data_form,
    named_optimizers,
    prepare_model_state,
    train_data_form,
)

__all__ = ["Trainer"]


_FLAT_WARNED: set[str] = set()  # The flat keywords this process was told about (once each).


def _taking_flat_options(init: Callable[..., None]) -> Callable[..., None]:
    """`Trainer.__init__` that also takes the groups' options as flat keywords, for one more release
    (`engine.options.FLAT_ALIASES`: `clip_norm=1.0` for `step=StepOptions(clip_norm=1.0)`): they become
    their groups before `init` runs (`engine.options.group_options`, which refuses a group given with
    one of its own), each with one warning a process naming its group. They are in no signature:
    help() and inspect.signature show `init`'s, the groups."""

    @functools.wraps(init)
    def init_with_groups(self: Any, **arguments: Any) -> None:
        flat = sorted(FLAT_ALIASES & arguments.keys())
        if flat:
            _warn_flat(flat)
            arguments = group_options(arguments, FLAT_ALIASES)
        init(self, **arguments)

    return init_with_groups


def _warn_flat(names: Sequence[str]) -> None:
    """One DeprecationWarning and log line for the flat keywords not yet warned about here."""
    new = [name for name in names if name not in _FLAT_WARNED]
    if not new:
        return
    _FLAT_WARNED.update(new)
    message = (
        f"Trainer's flat keywords are taken for one more release only: "
        f"{'; '.join(f'{name}= is {group_of(name)}' for name in new)}"
    )
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    logger.warning("%s", message)


def _resolved_checkpoint_options(
    strategy: tf.distribute.Strategy, options: CheckpointOptions
) -> CheckpointOptions:
    """`async_checkpoint` as the strategy allows it (`engine.checkpointing.background`)."""
    background = writes_in_background(strategy, options.async_checkpoint)
    return dataclasses.replace(options, async_checkpoint=background)


class Trainer:
    """Distributed, compiled custom training loop with eval, summaries and checkpoints.

    Create the model and optimizer inside `strategy.scope()`. Pass
    `loss_fn` (per-example losses from `(labels, logits)`; the engine does
    the cross-replica averaging) and/or `step_fn` (your own per-replica step
    returning a dict of scalars; then the loss scaling is yours). Evaluation
    uses `loss_fn` and `metrics`.

    The latest checkpoint in `model_dir` is restored on construction, so
    `trainer.step` says where training continues from.

    Args:
      strategy: the `tf.distribute.Strategy` the model was built under.
      model: a Keras model, a `tf.Module`, or either one holding the other;
        its variables are found through both (`engine.variables`).
      optimizer: one Keras optimizer, or a dict `{name: optimizer}` for a
        `step_fn` that applies several (GAN, encoder/decoder). Each is built
        here if it is not built yet: one optimizer on all trainable
        variables, a named one on those of `getattr(model, name)`. All are
        checkpointed; their rates are logged as `learning_rate` or
        `learning_rate/<name>`. Under a `mixed_float16` dtype policy (the
        model's) the standard step's optimizer is wrapped in a dynamic
        `keras.optimizers.LossScaleOptimizer`, as `compile()` wraps it
        (`engine.precision`); `trainer.optimizer` is then the wrapper. None:
        the one the Keras model was compiled with.
      train_data: one of the declared data forms (`engine.data`): a
        `tf.data.Dataset` of global batches (`GlobalBatches`),
        `fn(input_context)` of per-replica batches (`PerReplicaBatches`), a
        function of `start_step` that positions itself, or
        `engine.ResidentData` (arrays kept on every replica's device, batches
        gathered inside the compiled loop; its `host_data` under
        parameter-server and TPU). Each form resumes exactly (see
        `engine.data`). A finite dataset ends training with
        `DataExhaustedError`; its partial last batch trains as in `fit`.
      eval_data: the eval set, read whole at every evaluation: a finite
        `tf.data.Dataset` of global batches, `fn(input_context)` of
        per-replica batches, or `engine.ResidentEvalData` (arrays kept on every
        replica's device: no iterator to make per evaluation; its `host_data`
        under parameter-server and TPU). Every example counts once.
      global_batch_size: examples per step over all replicas; the first
        batch is checked against it before any update.
      loss_fn: per-element losses `fn(labels, outputs)` ((B,) a label per
        example, (B, T) per token), for the standard step (batches of
        `(features, labels[, sample_weight])`) and eval; a Keras loss with its
        default reduction is taken as the same loss with `reduction=None`. A
        compiled Keras model's own settings (loss, loss_weights, metrics), its own
        `train_step`/`test_step`/`predict_step`/`compute_loss` are taken as `fit`
        takes them (`engine.keras_model`). Nested like several outputs (a dict or
        list), one loss an output. Each output's loss is the mean over its
        real elements (Keras's output mask) of the GLOBAL batch
        (`engine.losses`).
      loss_weights: with a nested `loss_fn`, the weight of each output's loss,
        nested alike (Keras `compile(loss_weights=)`); None: 1.0 each.
      metrics, weighted_metrics: Keras metrics updated in training and
        evaluation, without and with the batches' sample weights (Keras
        `compile`'s split); they apply the outputs' masks as Keras does. The
        eval loss is the same mean over the real elements of the whole eval
        set, plus the regularization losses (`model.evaluate`'s).
      step_fn: your own per-replica step `fn(batch) -> {name: scalar}`; it
        cannot be combined with `clip_norm`, `grad_accum_steps > 1`,
        `jit_compile` or `on_nonfinite="skip"` (those shape the standard step).
      eval_step_fn: `fn(batch) -> (labels, predictions[, sample_weight])`
        for eval batches of another structure (e.g. dicts); evaluation then
        applies `loss_fn` and `metrics` to what it returns.
      callbacks: hooks (`engine.Callback`) and Keras callbacks (these act at
        the epoch ends of `Cadence.steps_per_epoch`).
      ema_decay: keep an exponential moving average of the weights with this
        decay (Keras's `use_ema`, set on the one optimizer before it is
        built); training is unchanged, evaluation, the best checkpoint and
        `averaged_weights()` use the averages. An optimizer created with
        `use_ema=True` gets the same without it (`engine.ema`).
      step: `engine.StepOptions(clip_norm=, grad_accum_steps=, jit_compile=,
        on_nonfinite=)`: how the standard step makes an update, and what a
        NaN/Inf loss or gradient (or a loss above `max_loss`) does: "stop" the
        run saving nothing, "skip" its update, or "rollback": restore the last
        good checkpoint and skip the batches that led to it (`engine.loop.rollback`).
      cadence: `engine.Cadence(steps_per_loop=, eval_every=, checkpoint_every=,
        log_every=, steps_per_epoch=)`: the most steps one compiled call runs
        (shared default with the CLI: `engine.options.DEFAULT_STEPS_PER_LOOP`),
        and every how many steps `train()` evaluates, saves and logs.
      checkpoint: `engine.CheckpointOptions(max_checkpoints=, restore_fallback=,
        restore_dir=, reset_optimizer=, async_checkpoint=)`: what is kept and
        restored. With `async_checkpoint` a save waits only for a copy of the
        variables; the files are written in the background, and the end of
        `train()` and `close()` wait for them (`engine.checkpointing.background`).
        Synchronous under multi-worker, parameter-server and TPU strategies.
      spikes: `engine.SpikeOptions(max_loss=, rollback_skip_batches=,
        max_rollbacks=)`: a finite loss above `max_loss` is a spike too (with
        "stop" or "rollback"); a rollback skips `rollback_skip_batches` more
        batches, at most `max_rollbacks` times.
      throughput: `engine.ThroughputOptions(flops_per_example=, peak_tflops=)`:
        the model's forward-pass FLOPs per example (e.g.
        `models.flops_per_example(model)`): the progress lines and TensorBoard
        then show the training TFLOP/s (3x forward), and with `peak_tflops`
        the MFU (achieved / peak). Unknown (None): neither is shown.

    Each group's fields (`engine.options`) carry their defaults and help, and a
    group refuses a bad value when it is made. The Trainer keeps them as
    `trainer.options` (`engine.options.TrainerOptions`): `trainer.step` is the
    global step and `trainer.checkpoint` what a checkpoint holds. The options
    taken flat before the groups (`clip_norm=1.0` for
    `step=engine.StepOptions(clip_norm=1.0)`) are still taken for one more
    release, with a warning naming the group (`engine.options.FLAT_ALIASES`).

    Raises:
      UserError: a bad argument, naming it, before anything is written.
    """

    @_taking_flat_options
    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        model: Any,
        optimizer: Optimizers | None = None,
        train_data: Data,
        global_batch_size: int,
        loss_fn: LossFn | None = None,
        loss_weights: Any = None,
        step_fn: ReplicaStep | None = None,
        eval_step_fn: EvalStep | None = None,
        metrics: Sequence[keras.metrics.Metric] = (),
        weighted_metrics: Sequence[keras.metrics.Metric] = (),
        eval_data: Data | None = None,
        model_dir: str | None = None,
        callbacks: Sequence[CallbackLike] = (),
        ema_decay: float | None = None,
        step: StepOptions | None = None,
        cadence: Cadence | None = None,
        checkpoint: CheckpointOptions | None = None,
        spikes: SpikeOptions | None = None,
        throughput: ThroughputOptions | None = None,
    ):
        self._start_clocks()
        options = TrainerOptions.of(
            step=step, cadence=cadence, checkpoint=checkpoint, spikes=spikes, throughput=throughput
        )
        # The options it runs with: `trainer.options` (not `trainer.step`, the global step).
        self.options = dataclasses.replace(
            options, checkpoint=_resolved_checkpoint_options(strategy, options.checkpoint)
        )
        self.model_flops = ModelFlops.from_forward(
            self.options.throughput.flops_per_example, self.options.throughput.peak_tflops
        )
        train_data = arrays_as_train_data(train_data, global_batch_size)
        if eval_data is not None:
            eval_data = arrays_as_eval_data(eval_data, global_batch_size)
        train_form = train_data_form(strategy, train_data, global_batch_size)
        self.keras_model = keras_arguments(
            model,
            strategy=strategy,
            optimizer=optimizer,
            loss_fn=loss_fn,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            step_fn=step_fn,
            eval_step_fn=eval_step_fn,
            shapes=lambda: label_and_output_shapes(strategy, model, train_form),
        )
        self._check_arguments(strategy, eval_data, global_batch_size)
        self._take_optimizers(strategy, model)
        eval_form = eval_data_form(strategy, eval_data, global_batch_size) if eval_data is not None else None
        # Before the optimizer is built: Keras makes the averages when it builds it.
        self.weight_averages: WeightAverages | None = weight_averages(self.optimizers, ema_decay)
        self.strategy = strategy
        self.model = model
        self.global_batch_size = global_batch_size
        self.model_dir = model_dir
        self._start_outer_loop_state(model_dir)
        self.callbacks = self._make_callbacks(callbacks, train_form)
        self._make_runners(train_form, eval_form, eval_step_fn)
        self._open_model_dir(model_dir)

    def _start_clocks(self) -> None:
        """What the Trainer keeps from its first line on: its run's wall clock and the custom gradients
        its traces register."""
        self.goodput_clock = GoodputClock()  # Research code's run starts here (`goodput()`).
        # The custom gradients its traces register in TensorFlow's global registry, with the graphs
        # they close over: removed once the Trainer is gone, or every Trainer of a sweep stays.
        self._custom_gradients: list[str] = []
        weakref.finalize(self, forget_custom_gradients, self._custom_gradients)
        # The global step as the host last read it, for a diagnostics report (`progress()`), which
        # must not read a variable: its device, or the parameter server holding it, may be stuck.
        self._step_seen: int | None = None

    def _check_arguments(
        self, strategy: tf.distribute.Strategy, eval_data: Data | None, global_batch_size: int
    ) -> None:
        """The arguments (once the model's compiled ones are taken in) on their own and together, and
        the loss they make; before anything is built (`engine.trainer.checks`)."""
        keras_model = self.keras_model
        check_arguments(
            strategy,
            keras_model.loss_fn,
            keras_model.step_fn,
            keras_model.metrics,
            keras_model.weighted_metrics,
            eval_data,
            global_batch_size,
            self.step_options,
            loss_from_model=keras_model.own_compute_loss,
            evaluates_itself=keras_model.own_test_step,
        )
        own_collectives(strategy)  # A user's raw MirroredStrategy beside another one (engine.strategy).
        loss_fn = keras_model.loss_fn
        self.objective = Objective(loss_fn, keras_model.loss_weights) if loss_fn is not None else None
        check_options(strategy, self.step_options.on_nonfinite, self.spike_options)

    def _take_optimizers(self, strategy: tf.distribute.Strategy, model: Any) -> None:
        """The optimizers by name, loss-scaled as `compile()` scales them."""
        optimizer = self.keras_model.optimizer
        step_fn = self.keras_model.step_fn
        self.optimizers = named_optimizers(optimizer)
        if step_fn is None and len(self.optimizers) > 1:
            raise UserError(
                f"the standard step applies one optimizer, got {len(self.optimizers)} "
                f"({', '.join(self.optimizers)}); pass `step_fn` to apply several"
            )
        if step_fn is None:  # As compile() under mixed_float16; a step_fn's loss scaling is its own.
            with strategy.scope():  # Before it is built or restored: the scale is optimizer state.
                self.optimizers = {name: with_loss_scaling(opt, model) for name, opt in self.optimizers.items()}
        # The optimizer (None when several are named: see `optimizers`).
        self.optimizer = (
            self.optimizers["optimizer"] if isinstance(optimizer, keras.optimizers.Optimizer) else None
        )

    def _start_outer_loop_state(self, model_dir: str | None) -> None:
        """What the outer loop keeps between calls: its target, speed, last evaluation and stops."""
        self.target_step: int | None = None  # The `steps` of the running train() call.
        self.reports_goodput = True  # train() ends with `report_goodput()`.
        self.last_goodput: dict[str, float] | None = None  # What the last `report_goodput()` reported.
        self._summaries = SummaryWriters(model_dir)
        self._steady_seconds = 0.0
        self._steady_examples = 0.0
        self._compiled_once = False
        self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, logs)
        # Both stay in force for later train() calls until clear_stop():
        self.stop_training = False  # Set by a callback (early stopping): stop after this loop.
        self.stopping = StopAgreement(self.strategy)  # request_stop() (a signal, a peer worker).
        # Which worker is slow (engine.stragglers): the standard step times its compute, the loop its input.
        self.stragglers = (
            StragglerReport.create(self.strategy, self.options.throughput, self.stopping)
            if self.keras_model.step_fn is None
            else None
        )

    def _make_callbacks(
        self, callbacks: Sequence[CallbackLike], train_form: DataForm | ResidentData
    ) -> list[Callback]:
        """Progress lines every `log_every` steps (every loop when None) first, then the user's
        hooks, then what variable-length batches need."""
        return [
            Progress(self.cadence.log_every),
            *as_callbacks(callbacks, steps_per_epoch=self.cadence.steps_per_epoch),
            *one_step_per_call(self.strategy, train_form, self.cadence.steps_per_loop, self.model),
        ]

    def _make_runners(
        self,
        train_form: DataForm | ResidentData,
        eval_form: DataForm | ResidentEvalData | None,
        eval_step_fn: EvalStep | None,
    ) -> None:
        """The model's state made ready (in scope, optimizers built), then the train step and the
        runners of training and evaluation (prediction's on the first `predict()`)."""
        strategy, model, keras_model = self.strategy, self.model, self.keras_model
        self.global_step = prepare_model_state(strategy, model, self.optimizers)
        if keras_model.uses_compiled_state:
            build_compiled_state(strategy, model, train_form)
        with strategy.scope():
            # Keras compile's split: `metrics` see no sample weights, `weighted_metrics` do. A model's
            # own train_step updates (and reports) its own metrics: the engine's would stay empty.
            own_step = keras_model.own_train_step
            train_unweighted = [] if own_step else [fresh_copy(m, model) for m in keras_model.metrics]
            train_weighted = [] if own_step else [fresh_copy(m, model) for m in keras_model.weighted_metrics]
        self.train_metrics = [*train_unweighted, *train_weighted]
        self.replica_step = keras_model.step_fn or self._standard_step(train_unweighted, train_weighted)
        # Step k trains on stream position k + offset (the batches rollbacks skipped).
        self.data_position = DataPosition()
        self.train_runner = self._make_train_runner(train_form, self.global_batch_size)
        self.eval_runner: EvalRunner | KerasEvalRunner | None = None
        if eval_form is not None and keras_model.own_test_step:
            self.eval_runner = KerasEvalRunner(
                strategy, model, host_form_of(eval_form), batches_per_call=self.cadence.steps_per_loop
            )
        elif eval_form is not None:
            assert self.objective is not None, "checked: eval_data needs loss_fn"
            self.eval_runner = self._make_eval_runner(
                self.objective,
                eval_form,
                metrics=keras_model.metrics,
                weighted_metrics=keras_model.weighted_metrics,
                eval_step_fn=eval_step_fn,
            )
        if self.eval_runner is not None:  # Each eval call that traces is compile time, the others eval time.
            self.eval_runner.loop = TimedFunction(self.eval_runner.loop, self.goodput_clock, "eval")
        self.eval_metrics = self.eval_runner.metrics if self.eval_runner is not None else []
        self._predict_runner: PredictRunner | None = None  # Made by the first predict().

    def _open_model_dir(self, model_dir: str | None) -> None:
        """The callbacks' last checks, then (every check passed) the restore from `model_dir`, the
        rollback's start and the callbacks' own state; partial checkpoint folders go last."""
        for callback in self.callbacks:  # Before anything touches the model_dir.
            callback.check_trainer(self)
        self.checkpointer: Checkpointer | None = None
        if model_dir is not None:
            self.checkpointer = self._make_checkpointer(model_dir, self.options.checkpoint)
            with self.goodput_clock.phase("restore"):
                self._restore()
        self.rollback = self._make_rollback() if self.step_options.on_nonfinite == "rollback" else None
        for callback in self.callbacks:  # Their own state on disk, now that the step is known.
            callback.restore_state(self)
        if model_dir is not None:  # Every check passed: the partial folders of writes cut short go.
            discovery.remove_partial_checkpoints(model_dir)

    def _make_rollback(self) -> Rollback:
        """What `on_nonfinite="rollback"` restores: the data position joins what is checkpointed."""
        if self.checkpointer is None:
            checkpoint = self._checkpoint_object()
            setattr(checkpoint, CHECKPOINT_KEY, self.data_position)
        else:  # In every checkpoint from now on; after the restore, which may be of a run without rollback.
            checkpoint = self.checkpointer.checkpoint
            self.checkpointer.track(CHECKPOINT_KEY, self.data_position)
        return Rollback(
            checkpoint,
            global_step=self.global_step,
            position=self.data_position,
            checkpointer=self.checkpointer,
            options=self.spike_options,
        )

    @property
    def cadence(self) -> Cadence:
        """When the outer loop evaluates, saves and logs (`options.cadence`)."""
        return self.options.cadence

    @property
    def step_options(self) -> StepOptions:
        """How the standard step makes an update (`options.step`: not `step`, the global step)."""
        return self.options.step

    @property
    def spike_options(self) -> SpikeOptions:
        """What counts as a loss spike and how often to roll back (`options.spikes`)."""
        return self.options.spikes

    def _standard_step(self, metrics: list[Any], weighted_metrics: list[Any]) -> ReplicaStep:
        own_loss = self.keras_model.own_compute_loss
        assert self.objective is not None or own_loss, "checked: loss_fn, compute_loss or step_fn"
        return make_train_step(
            model=self.model,
            extra_loss=functools.partial(loss_beyond_keras, self.model) if own_loss else None,
            optimizer=next(iter(self.optimizers.values())),  # The standard step applies one.
            objective=self.objective,
            global_batch_size=self.global_batch_size,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            grad_norm=any(c.needs_grad_norm for c in self.callbacks),
            compute_clock=self.stragglers.clock if self.stragglers is not None else None,
            **self.step_options.step_arguments(),
        )

    def _checkpoint_object(self) -> tf.train.Checkpoint:
        """What a checkpoint holds (`engine.checkpointing.checkpointer.checkpoint_of`; with rollback, the data
        position joins it: `engine.loop.rollback`)."""
        return checkpoint_of(self.model, self.global_step, self.optimizers)

    def _make_checkpointer(self, model_dir: str, options: CheckpointOptions) -> Checkpointer:
        checkpoint = self._checkpoint_object()
        checkpointer = Checkpointer(
            model_dir, checkpoint, model=self.model, step_counter=self.global_step, options=options
        )
        if holds_position(checkpointer.restore_path):  # Written with rollback: the position goes on.
            checkpointer.track(CHECKPOINT_KEY, self.data_position)
        return checkpointer

    def _make_predict_runner(self) -> PredictRunner:
        return PredictRunner(self.strategy, self.model, own_predict_step=self.keras_model.own_predict_step)

    def _make_train_runner(self, data: DataForm | ResidentData, global_batch_size: int) -> TrainRunner:
        return TrainRunner(
            self.strategy,
            self.replica_step,
            self.global_step,
            data,
            global_batch_size=global_batch_size,
            position=self.data_position,
            max_loss=self.spike_options.max_loss,
            replica_state=replica_local_state(self.strategy, self.model),
            input_clock=self.stragglers.input_clock if self.stragglers is not None else None,
        )

    def _make_eval_runner(
        self, objective: Objective, data: DataForm | ResidentEvalData, **options: Any
    ) -> EvalRunner:
        return EvalRunner(
            self.strategy, self.model, objective, data, batches_per_call=self.cadence.steps_per_loop, **options
        )

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        """The global step: the number of updates applied (equal to each optimizer's `iterations`
        for the standard step)."""
        return int(self.global_step.numpy())

    @property
    def keeps_data_on_devices(self) -> bool:
        """Whether training batches are gathered on the replicas' devices (`ResidentData`)
        rather than read through a tf.data iterator."""
        return self.train_runner.keeps_data_on_devices

    @property
    def train_loop(self):
        """The compiled training call (one trace for every loop length)."""
        return self.train_runner.loop

    @property
    def eval_loop(self):
        """The compiled evaluation call; None without eval_data."""
        return None if self.eval_runner is None else self.eval_runner.loop

    @property
    def checkpoint_manager(self) -> tf.train.CheckpointManager | None:
        """The `tf.train.CheckpointManager` of `<model_dir>/checkpoints`; None without model_dir."""
        return None if self.checkpointer is None else self.checkpointer.manager

    def _restore(self) -> None:
        assert self.checkpointer is not None, "only with a model_dir"
        rates = {name: _constant_learning_rate(opt) for name, opt in self.optimizers.items()}
        path = self.checkpointer.restore()
        if path is None:
            return
        if self.data_position.offset.numpy() and self.train_runner.position is None:
            skipped = int(self.data_position.offset.numpy())
            raise UserError(
                f"checkpoint {path} was trained past {skipped} batches skipped by rollbacks, which "
                f"{type(self.train_runner).__name__} cannot skip; resume it with the strategy it trained with"
            )
        if self.checkpointer.options.reset_optimizer and self.weight_averages is not None:
            self.weight_averages.reset_to_weights()  # Not from zero: the step count is not 0.
        if not any(c.owns_learning_rate for c in self.callbacks):
            # The checkpoint holds the old run's learning rate; the optimizer
            # the user passed now (e.g. a new learning rate) wins, unless a
            # hook (reduce on plateau) set the rate and must find it again.
            for name, rate in rates.items():
                if rate is not None:
                    self.optimizers[name].learning_rate = rate
        logger.info("Restored %s at step %d", path, self.step)

    def save(self) -> str | None:
        """Writes a checkpoint at the current step (no-op without model_dir)."""
        return self._save(background=True)

    def _save(self, *, background: bool) -> str | None:
        """`background=False` where nothing trains before the write is waited for (the end of
        train()): a background write copies the variables first, which then only adds time
        (the quick start's one save: 0.2 s blocked copying, against < 0.05 s writing)."""
        if self.checkpointer is None:
            return None
        with self.goodput_clock.phase("checkpoint"):  # The time the loop is blocked saving.
            return self.checkpointer.save(self.step, background=background)

    @property
    def rollbacks(self) -> int:
        """Rollbacks after loss spikes (`on_nonfinite="rollback"`), over the checkpoints' history."""
        return int(self.data_position.rollbacks.numpy())

    def _latest_checkpoint(self) -> str | None:
        return None if self.checkpointer is None else self.checkpointer.latest

    # ---------------------------------------------------------------- training

    def averaged_weights(self) -> contextlib.AbstractContextManager:
        """`with trainer.averaged_weights():` the model holds the moving averages of its
        weights (`ema_decay`), and the training weights again, exactly, after the block;
        without averages the weights stay as they are."""
        return averages_swapped_in(self.weight_averages)

    def request_stop(self) -> None:
        """Stops training after the current loop (with a checkpoint); safe to
        call from a signal handler or another thread. Like `stop_training`,
        it stays in force for later train() calls until `clear_stop()`."""
        self.stopping.request()

    @property
    def stop_requested(self) -> bool:
        """Whether `request_stop()` was called (here or, multi-worker, on a peer)."""
        return self.stopping.requested

    @property
    def stop_agreed(self) -> bool:
        """Whether training stopped on a request every worker agreed to (one process: any
        request). What to do next (evaluate, or exit as stopped) must follow this, not
        `stop_requested`: a signal that lands after the last agreement reached one worker only."""
        return self.stopping.agreed

    def clear_stop(self) -> None:
        """Lifts a stop (`request_stop()` or `stop_training`), so the next train() trains."""
        self.stopping.clear()
        self.stop_training = False

    def _should_stop(self) -> bool:
        """Whether to stop before the next loop, agreed by every worker (`engine.stopping`).
        Callbacks decide from all-reduced metrics and so agree already."""
        if self.stop_training:
            return True
        if self.stragglers is None:
            return self.stopping.should_stop()
        stop = self.stopping.should_stop(self.stragglers.figures())
        self.stragglers.agreed(self.stopping.figures, self.step, self._summaries)
        return stop

    def train(self, steps: int) -> dict[str, float]:
        """Trains until the global step reaches `steps`; returns the last loop's logs.

        `steps` is an absolute target, so a restarted job with the same
        arguments does only the remaining work: at or past it, train() logs
        that there is nothing to do and returns `{}`. A stop in force
        (`request_stop()`, `stop_training`) ends it after the current loop,
        with a checkpoint, and keeps later calls from training until
        `clear_stop()`.

        Args:
          steps: the global step to reach.

        Returns:
          The last loop's logs: loss, metrics, speed and learning rate(s);
          `{}` when no loop ran.

        Raises:
          DataExhaustedError: the training data ended first; a checkpoint
            at the last completed step (`trainer.step`) was saved.
          NonFiniteLossError: a NaN/Inf loss (or one above `max_loss`) under
            `on_nonfinite="stop"`, or after `max_rollbacks` rollbacks; nothing was saved.
          UserError: `steps` is negative, or the batch size is wrong.
        """
        if steps < 0:
            raise UserError(f"train(`steps={steps}`) must not be negative")
        logs: dict[str, float] = {}
        last_saved = self.step
        self.target_step = steps
        if self.step >= steps:
            logger.info("nothing to train: the global step %d is already at or past steps=%d", self.step, steps)
            return logs
        if self.stop_training or self.stopping.requested:
            logger.warning(
                "not training: a stop is in force at step %d (trainer.clear_stop() lifts it)", self.step
            )
            return logs
        for callback in self.callbacks:
            callback.on_train_begin(self)
        if self.rollback is not None:
            self.rollback.keep_start()  # What a spike before the next checkpoint restores.
        while self.step < steps and not self._should_stop():
            start = self._step_seen = self.step
            num_steps = self._next_loop_length(start, steps)
            loop_logs = self._train_one_loop(start, num_steps, steps, last_saved)
            self._step_seen = self.step
            if self.stragglers is not None:
                self.stragglers.loop_done(self.step - start)
            if loop_logs is None:  # Rolled back to a checkpoint (or the start): nothing to save there.
                last_saved = self.step
                continue
            logs = loop_logs
            for callback in self.callbacks:
                callback.on_loop_end(self, self.step, logs)
            if self.step - start < num_steps:
                self._end_on_exhausted_data(steps, last_saved, logs)
            if self.evaluates_after(self.step):
                self.evaluate()
            if self.cadence.checkpoints_after(self.step):
                self._save(background=self.step < steps)  # The last is waited for at once.
                last_saved = self.step
        self._step_seen = self.step
        self._save_unless_saved(last_saved)
        for callback in self.callbacks:
            callback.on_train_end(self, logs)
        if self.reports_goodput:
            self.report_goodput()
        return logs

    def progress(self) -> dict[str, Any]:
        """What the outer loop is doing, from values the host keeps (no variable is read, so it
        answers while a compiled call or a peer is stuck): for `engine.diagnostics` reports."""
        current = self.goodput_clock.current()
        doing = "between phases" if current is None else f"{current[0]} for {current[1]:.1f} s"
        if current is not None and current[0] == "train" and self._step_seen is not None:
            doing += f" (a loop from step {self._step_seen}, training to step {self.target_step})"
        return {
            "last completed step": self._step_seen,
            "doing": doing,
            "stop requested": self.stopping.requested,
        }

    def goodput(self) -> dict[str, float]:
        """Where the wall time went since the Trainer was created (`engine.goodput`): `total_s`,
        `startup_s`, `compile_s`, `train_s`, `eval_s`, `checkpoint_s`, `restore_s` (seconds) and
        `fraction` = train_s / total_s."""
        return self.goodput_clock.figures()

    def report_goodput(self, extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """The figures so far (and `extra` ones) as `goodput/*` scalars at this step and one log line;
        returns them. train() calls it at its end unless `reports_goodput` is False (the command
        line reports once, after its final evaluation)."""
        figures = {**self.goodput(), **(extra or {})}
        self._summaries.write("train", self.step, scalars(figures))
        logger.info("%s", wrap_line(breakdown_line(figures), message_width()))
        self.last_goodput = figures
        return figures

    def _train_one_loop(
        self, start: int, num_steps: int, target: int, last_saved: int
    ) -> dict[str, float] | None:
        """Runs one compiled call and returns its logs (written to TensorBoard); ends the
        run where the data ran out before its first step or a step was not finite, or
        rolls back (`on_nonfinite="rollback"`) and returns None."""
        for metric in self.train_metrics:
            metric.reset_state()
        if isinstance(self.replica_step, KerasTrainStep):
            self.replica_step.start_loop()  # Its outputs are the model's metrics since their reset.
        began = time.perf_counter()
        with (
            self.goodput_clock.call(self.train_runner.loop, "train") as call,  # A call that traced: compile.
            self._owning_custom_gradients(),
        ):
            result = self.train_runner.run(start, num_steps)
            call.steps = result.steps_run
        seconds = time.perf_counter() - began
        if result.steps_run == 0:  # Not one batch was left: nothing ran, nothing to log.
            self._end_on_exhausted_data(target, last_saved, {})
        if result.first_nonfinite_index >= 0 and self.step_options.on_nonfinite != "skip":
            spike = Spike(start + result.first_nonfinite_index + 1, result.first_nonfinite_loss)
            if self.rollback is None or self.rollback.exhausted:
                self._stop_on_nonfinite(spike)
            self.rollback.recover(spike, self._summaries)
            return None
        logs = dict(result.logs)
        if isinstance(self.replica_step, KerasTrainStep):
            logs = metrics_result_or_logs(self.model, logs)
        # The standard step counts its examples (a partial last batch holds fewer); a step_fn's, by the batch.
        examples_per_step = logs.pop(STEP_EXAMPLES, float(self.global_batch_size))
        if self.step_options.on_nonfinite == "skip":  # Under "stop" it is 0, or the run ended above.
            logs["nonfinite_steps"] = float(result.nonfinite_steps)
        logs.update(metric_logs(self.train_metrics))  # A vector-valued one per entry (`f1_score/0`, ...).
        logs.update(self._speed(result.steps_run, examples_per_step * result.steps_run, seconds))
        logs.update(self._learning_rates())
        self._summaries.write("train", self.step, logs)
        return logs

    @contextlib.contextmanager
    def _owning_custom_gradients(self) -> Iterator[None]:
        """Around a call that may trace: the custom gradients it registers are this Trainer's, removed
        when it is dropped (`engine.compat.custom_gradient_names`); its functions are never differentiated."""
        before = custom_gradient_names()
        try:
            yield
        finally:
            self._custom_gradients.extend(custom_gradient_names() - before)

    def _save_unless_saved(self, last_saved: int) -> None:
        """The end of a run: a checkpoint at its last step, and at least one."""
        if self.checkpointer is not None and (self.step != last_saved or self.checkpointer.latest is None):
            self._save(background=False)
        if self.checkpointer is not None:
            self.checkpointer.wait()  # A background write ends with the run, its error raised.

    def _stop_on_nonfinite(self, spike: Spike) -> NoReturn:
        """Ends the run without saving: the weights hold the spike's update (NaNs, maybe), so the
        model in memory goes back to the latest checkpoint where there is one, and the message
        says which weights it holds (research code may go on using it)."""
        self._summaries.close()
        message = stop_message(
            spike, self.spike_options, self._latest_checkpoint(), rolled_back=self.rollback is not None
        )
        latest = self._latest_checkpoint()
        if latest is not None:
            # Model, step, optimizer(s) and random state; not the data position, which a run that
            # wrote the checkpoint without rollback does not hold.
            checkpoint_of(self.model, self.global_step, self.optimizers).read(latest).expect_partial()
            held = f"the model in memory is back at {latest} (step {self.step})"
        else:
            held = "the model in memory holds the spike's update (no checkpoint to go back to)"
        raise NonFiniteLossError(f"{message}; {held}")

    def _end_on_exhausted_data(self, target: int, last_saved: int, logs: Mapping[str, float]) -> None:
        """Saves at the last completed step, then stops the run: training on
        would need data that is not there, and returning quietly would
        leave the caller believing the target was reached."""
        self._step_seen = self.step
        self._save_unless_saved(last_saved)
        for callback in self.callbacks:
            callback.on_train_end(self, logs)
        saved = f"; checkpoint saved in {self.model_dir}" if self.checkpointer is not None else ""
        raise DataExhaustedError(
            f"the training data ran out after step {self.step} of {target}{saved}; "
            "call .repeat() on the dataset (before .batch) to train longer than one pass",
            step=self.step,
        )

    def _learning_rates(self) -> dict[str, float]:
        if self.optimizer is not None:
            return {"learning_rate": _current_learning_rate(self.optimizer)}
        return {f"learning_rate/{name}": _current_learning_rate(opt) for name, opt in self.optimizers.items()}

    def _next_loop_length(self, start: int, target: int) -> int:
        length = self.cadence.loop_length(start, target)
        for callback in self.callbacks:
            limit = callback.loop_limit(self, start)
            if limit:
                length = min(length, limit)
        return length

    def evaluates_after(self, step: int) -> bool:
        """Whether the loop that ends at `step` is followed by an evaluation (`TrainerView`)."""
        return self.cadence.evaluates_after(step) and self.eval_runner is not None

    def _speed(self, num_steps: int, examples: float, seconds: float) -> dict[str, float]:
        """Throughput of this loop; the first loop (tracing, compiling) is left
        out of the steady rate that `examples_per_second` reports."""
        if self._compiled_once:
            self._steady_seconds += seconds
            self._steady_examples += examples
        self._compiled_once = True
        examples_per_second = examples / seconds
        return {
            "steps_per_second": num_steps / seconds,
            "examples_per_second": examples_per_second,
            **self.model_flops.rates(examples_per_second),  # tflops, mfu: where the FLOPs are known.
        }

    @property
    def summaries(self) -> SummaryWriters:
        """The TensorBoard writers (one a split), for hooks that write more than scalars."""
        return self._summaries

    @property
    def checkpoint(self) -> tf.train.Checkpoint | None:
        """What the checkpoints hold (model, step, optimizers), for a hook that saves one of
        its own (`TrainerView`); None without model_dir."""
        return None if self.checkpointer is None else self.checkpointer.checkpoint

    @property
    def steady_examples_per_second(self) -> float | None:
        """Examples/s over every loop but the first; None until there are two."""
        if not self._steady_examples:
            return None
        return self._steady_examples / self._steady_seconds

    # -------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        """Runs over the whole eval set once; metrics cover every example.

        A stop request (`request_stop`) ends it after the running chunk of at
        most `steps_per_loop` batches; it then returns {} and records nothing.
        With `ema_decay`, it evaluates the averaged weights (`averaged_weights`).

        Returns:
          `{"loss": ..., <metric>: ..., "num_examples": n}` at the current step.

        Raises:
          UserError: the trainer has no `eval_data` (or no `loss_fn`).
        """
        if self.eval_runner is None:
            raise UserError("evaluate() needs eval_data and a loss_fn")
        with self.goodput_clock.phase("eval"), self.averaged_weights(), self._owning_custom_gradients():
            # Several workers must run the same chunks (each batch is agreed by all-reduce).
            result = self.eval_runner.run(lambda: self.stopping.requested and self.stopping.all_reduce is None)
        if result is None:
            logger.warning("evaluation at step %d stopped by a stop request; no eval results", self.step)
            return {}
        self._summaries.write("eval", self.step, result)
        logger.info("%s", wrap_line(f"eval at step {self.step}  {format_logs(result)}", message_width()))
        self.last_eval = (self.step, result)
        for callback in self.callbacks:
            callback.on_eval_end(self, self.step, result)
        return result

    def predict(self, data: Any) -> Any:
        """The model's outputs for every example of `data`, in its order, as `model.predict`
        returns them, computed over the replicas (on the averaged weights with `ema_decay`).

        Args:
          data: a finite `tf.data.Dataset` of global batches (of features, or of
            `(features, labels[, sample_weight])` whose labels are ignored), or arrays
            (a dict or tuple of arrays) of examples, batched by `global_batch_size`.

        Returns:
          numpy arrays nested as the model's outputs, one row per example.
        """
        if self._predict_runner is None:
            self._predict_runner = self._make_predict_runner()
        with self.averaged_weights(), self._owning_custom_gradients():
            return self._predict_runner.run(as_prediction_batches(data, self.global_batch_size))

    def evaluate_current(self) -> dict[str, float]:
        """The evaluation at the current step, reusing one the loop already ran."""
        if self.last_eval is not None and self.last_eval[0] == self.step:
            return self.last_eval[1]
        return self.evaluate()

    def close(self) -> None:
        """Waits for a checkpoint still being written, then closes the summary writers and lets go
        of the training iterator (freed off this thread; a later train() makes a new one)."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait()
        finally:
            self._summaries.close()
            self.train_runner.release_iterator()
            if self.rollback is not None:
                self.rollback.discard_start()


def _constant_learning_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    # `learning_rate`, not `_learning_rate`: a LossScaleOptimizer forwards the
    # former to the optimizer it wraps, while its own `_learning_rate` is not the rate.
    if is_scheduled(optimizer):
        return None
    return _current_learning_rate(optimizer)


def _current_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    # A distributed Keras variable does not convert with float(); read it as a tensor.
    return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())
