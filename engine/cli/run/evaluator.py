"""`--mode=eval` and `--mode=continuous_eval`: evaluate checkpoints another process wrote.

The evaluator only reads the model_dir's checkpoints. It builds the model
and optimizer as the training job does, restores each checkpoint with a
plain `tf.train.Checkpoint.read` (no `CheckpointManager`, which could
rotate or set aside the trainer's files, and no writer lock), and runs the
training's own compiled eval loop (`engine.loop.runners.EvalRunner`) over the whole
eval set. `--mode=continuous_eval` evaluates every checkpoint, in order, however many
training writes between two looks (`_new_checkpoints`). It writes only
its eval summaries (at the checkpoint's step, to the `eval` run) and
`metrics.json`, the latter in `--mode=eval` or once training has finished.

An `evaluator` task (TF_CONFIG or `--task_type=evaluator`) is a
continuous evaluator beside a cluster: it never trains.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from absl import logging

from engine import model_dir as model_dir_lib
from engine.callbacks.progress import format_logs
from engine.checkpointing import checkpointer as checkpoint_lib
from engine.checkpointing.checkpointer import CheckpointVanished, files_gone
from engine.checkpointing.discovery import latest_checkpoint, listed_checkpoints
from engine.cli.config.config_files import read_stored_config
from engine.cli.config.settings import RunConfig
from engine.cli.config.settings.sections import DecisionSettings, StateSettings
from engine.cli.run.assembly import CheckpointedModel
from engine.cli.run.run_record import read_record, record_evaluations, record_path
from engine.cli.run.run_task import check_reported
from engine.cluster import Cluster
from engine.data import as_eval_form
from engine.errors import UserError
from engine.hooks.best_checkpoint import BestCheckpoint
from engine.logger import logger, message_width, wrap_line
from engine.loop.runners import EvalRunner
from engine.losses import Objective
from engine.summaries import SummaryWriters

POLL_SECONDS = 1.0
# How long a continuous evaluator waits, after the final step, for the trainer's metrics.json.
TRAINER_FINISH_SECONDS = 60.0
MISSED_LISTED = 10  # Checkpoints a "not evaluated" line names; past that, how many more.


def evaluation_mode(mode: str, cluster: Cluster | None) -> str | None:
    """ "eval" or "continuous_eval" when this process (in --mode=`mode`, a task of `cluster`)
    evaluates instead of training, else None."""
    if mode in ("eval", "continuous_eval"):
        return mode
    if cluster is not None and cluster.is_evaluator:
        return "continuous_eval"
    return None


def _model_dir(state: StateSettings) -> str:
    """The model_dir an evaluator reads; RunConfig.validate requires one for both eval modes."""
    assert state.model_dir, "validated: --mode=eval/continuous_eval needs --model_dir"
    return state.model_dir


def run(config: RunConfig, mode: str) -> dict[str, Any]:
    """Evaluates as `mode` says; returns the step and the logs of the last evaluation
    (`record_evaluations` adds them to metrics.json)."""
    model_dir_lib.check_kinds(_model_dir(config.state))
    read_record(_model_dir(config.state))  # Damaged: refused now, not after evaluating.
    with model_dir_lib.disk_full_is_a_user_error(_model_dir(config.state)):
        return _run(config, mode)


def _run(config: RunConfig, mode: str) -> dict[str, Any]:
    if mode == "eval":
        model_dir = _model_dir(config.state)
        path = latest_checkpoint(checkpoint_lib.checkpoint_dir(model_dir))
        if path is None:
            raise UserError(
                f"--mode=eval: no checkpoint in {checkpoint_lib.checkpoint_dir(model_dir)}; "
                "train first or pass the --model_dir of a trained run"
            )
        step, logs = Evaluator(config).evaluate(path, strict=True)
        record_evaluations(model_dir, [(step, logs)], mode="eval")
        return {"global_step": step, "eval": logs, "model_dir": config.model_dir}
    return Evaluator(config).run_continuously()


class Evaluator:
    """The training job's model, optimizer and eval data, for evaluating its checkpoints read-only.

    What it builds is what the checkpoints hold (model, optimizer slots and
    averages, global step), restored by a `CheckpointReader`; an `EvalRunner`
    evaluates it. Nothing trains, nothing rotates, nothing takes the lock.
    """

    def __init__(self, config: RunConfig):
        self.config = config
        self.model_dir = _model_dir(config.state)
        restored = CheckpointedModel(config, model_dir=self.model_dir)
        source = restored.source
        if source.num_eval_examples is None:
            raise UserError(f"--dataset={config.dataset} has no eval split to evaluate on")
        self.restored, self.strategy, self.final_step = restored, restored.strategy, restored.final_step
        self.model, self.optimizer, self.reader = restored.model, restored.optimizer, restored.reader
        batch = config.global_batch_size
        check_reported(config.decisions, restored.task)
        task = restored.task.trainer_arguments(restored.model)
        self.runner = EvalRunner(
            self.strategy,
            self.model,
            Objective(task["loss_fn"], task.get("loss_weights")),
            as_eval_form(lambda context: source.eval_dataset(global_batch_size=batch, input_context=context)),
            metrics=task["metrics"],
            eval_step_fn=task.get("eval_step_fn"),
            batches_per_call=config.steps_per_loop,
        )
        self.summaries = SummaryWriters(config.model_dir)
        self._best = self._best_checkpoint(config.decisions)

    @property
    def step(self) -> int:
        return self.restored.step

    def averaged_weights(self) -> contextlib.AbstractContextManager:
        return self.restored.averaged_weights()

    def _best_checkpoint(self, decisions: DecisionSettings) -> BestCheckpoint | None:
        """--best_checkpoint_metric: the hook the trainer would run, keeping <model_dir>/best
        (its own manager there; the training's checkpoints are never touched)."""
        if not decisions.best_checkpoint_metric:
            return None
        hook = BestCheckpoint(decisions.best_checkpoint_metric)
        hook.on_train_begin(self._view())
        return hook

    def _view(self) -> _EvaluatorView:
        """The `TrainerView` BestCheckpoint sees: the training's model_dir and this evaluator's checkpoint."""
        return _EvaluatorView(self)

    def evaluate(self, path: str, *, strict: bool) -> tuple[int, dict[str, float]]:
        """Restores `path` (read only) and evaluates it; returns (its step, the eval logs).

        `strict`: a checkpoint that cannot be read is an error, not a skip.
        """
        self.reader.read(path, strict=strict)
        step = self.step
        try:
            with self.averaged_weights():
                logs = self.runner.run()
            assert logs is not None, "nothing requests a stop during an evaluator's evaluation"
            logger.info("%s", wrap_line(f"eval at step {step}  {format_logs(logs)}", message_width()))
            self.summaries.write("eval", step, logs)
            if self._best is not None:
                self._best.on_eval_end(self._view(), step, logs)
        except tf.errors.OpError as error:  # A restoration deferred until now read the files.
            if strict or not files_gone(path):
                raise
            raise CheckpointVanished(f"{path}: {type(error).__name__} while evaluating it") from None
        return step, logs

    def run_continuously(self) -> dict[str, Any]:
        """Evaluates every checkpoint once, in order, until the final step's (or `eval_timeout` idle
        seconds)."""
        config = self.config
        logging.info(
            "continuous evaluation of %s until step %d (or %gs without a new checkpoint)",
            checkpoint_lib.checkpoint_dir(self.model_dir),
            self.final_step,
            config.eval_timeout,
        )
        last: tuple[int, dict[str, float]] | None = None
        evaluations: list[tuple[int, dict[str, float]]] = []
        self._stop = _StopFlag()
        for path in self._new_checkpoints():
            try:
                last = self.evaluate(path, strict=False)
            except CheckpointVanished as error:
                logging.warning("skipped %s: rotation deleted it while it was read", error)
                continue
            evaluations.append(last)
            if last[0] >= self.final_step:
                break
        self.summaries.close()
        if self._stop.signum is not None:  # Like a stopped training run: 128 + the signal.
            return {"global_step": last and last[0], "exit_status": 128 + self._stop.signum}
        if last is None:
            logging.warning("no checkpoint to evaluate appeared in %s", config.model_dir)
            return {"global_step": None, "eval": {}}
        result = {"global_step": last[0], "eval": last[1], "model_dir": config.model_dir}
        if last[0] >= self.final_step:
            self._merge_into_trainer_metrics(result, evaluations)
        return result

    def _new_checkpoints(self) -> Iterator[str]:
        """Paths of the checkpoints written since the last one yielded, oldest first, each once
        (every point of the eval curve, however many the trainer wrote between two looks); ends
        after eval_timeout idle seconds or on SIGTERM/SIGINT (between evaluations).

        Read from the state file, which names a checkpoint only once it is complete
        (`listed_checkpoints`). Those rotation deleted before their turn are named
        (`_warn_missed`); those there when the evaluator starts are all evaluated.
        """
        directory = checkpoint_lib.checkpoint_dir(self.model_dir)
        last: int | None = None  # The step of the newest checkpoint yielded; None before the first look.
        seen: set[int] = set()  # Steps the state file named at some look.
        idle_since = time.monotonic()
        while not self._stop.signum:
            listed = listed_checkpoints(directory)
            pending = [(step, path) for step, path in listed if last is None or step > last]
            if pending:
                step, path = pending[0]
                if last is not None:
                    self._warn_missed(last, step, seen)
                seen.update(listed_step for listed_step, _ in listed)
                last = step
                yield path
                idle_since = time.monotonic()
                continue
            seen.update(listed_step for listed_step, _ in listed)
            if last is None:
                last = 0  # Nothing there yet: every checkpoint from now on is the evaluator's.
            if time.monotonic() - idle_since > self.config.eval_timeout:
                logging.warning("no new checkpoint for %gs (--eval_timeout); stopping", self.config.eval_timeout)
                return
            time.sleep(POLL_SECONDS)
        logging.warning("%s received: stopping the evaluation", signal.Signals(self._stop.signum).name)

    def _warn_missed(self, after: int, before: int, seen: set[int]) -> None:
        """One line naming the checkpoints written after step `after` and before `before` that
        rotation (--max_checkpoints) deleted before the evaluator got to them."""
        steps = missed_steps(after, before, seen, self._trainer_checkpoint_every())
        if not steps:
            return
        names = ", ".join(f"ckpt-{step}" for step in steps[:MISSED_LISTED])
        more = f" and {len(steps) - MISSED_LISTED} more" if len(steps) > MISSED_LISTED else ""
        logging.warning(
            "not evaluated: %s%s (after step %d, before %d): --max_checkpoints deleted them before the "
            "evaluator got to them, so the eval curve has no point there; keep more checkpoints "
            "(--max_checkpoints) or evaluate less (a smaller eval set) to keep up",
            names,
            more,
            after,
            before,
        )

    def _trainer_checkpoint_every(self) -> int | None:
        """The trainer's --checkpoint_every: from the config.yaml it keeps in the model_dir (it
        may have started after this evaluator), else this evaluator's own."""
        try:
            stored = read_stored_config(self.model_dir)
        except UserError:  # Damaged (or replaced mid-read): the evaluator's own settings.
            stored = None
        every = self.config.checkpoint_every
        if stored is not None:
            every = stored.values.get("checkpoint_every", every)
        return every or None

    def _merge_into_trainer_metrics(
        self, result: dict[str, Any], evaluations: list[tuple[int, dict[str, float]]]
    ) -> None:
        """metrics.json is the trainer's until it finished: wait for its final version, then
        add this evaluator's evaluations."""
        deadline = time.monotonic() + TRAINER_FINISH_SECONDS
        while time.monotonic() < deadline:
            try:
                written = read_record(self.model_dir)
            except UserError:  # Being replaced (written atomically, but read between two writes).
                written = {}
            if written.get("global_step") == result["global_step"]:
                record_evaluations(self.model_dir, evaluations, mode="continuous_eval")
                logging.info("wrote the evaluations to %s", record_path(self.model_dir))
                return
            time.sleep(POLL_SECONDS)
        logging.warning(
            "training has not written %s for step %d; left it alone",
            record_path(self.model_dir),
            result["global_step"],
        )


class _StopFlag:
    """Records SIGTERM/SIGINT while waiting for checkpoints (the evaluator saves nothing)."""

    def __init__(self):
        self.signum: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum, frame) -> None:
        self.signum = signum
        for handled in (signal.SIGTERM, signal.SIGINT):  # A second signal ends the process.
            signal.signal(handled, signal.SIG_DFL)


def missed_steps(after: int, before: int, seen: set[int], every: int | None) -> list[int]:
    """The steps of the checkpoints a trainer wrote after step `after` and before `before`:
    those a look saw named (`seen`) and the multiples of its `--checkpoint_every` (`every`;
    the trainer saves at each, its loops cut there), in order."""
    steps = {step for step in seen if after < step < before}
    if every:
        steps.update(range((after // every + 1) * every, before, every))
    return sorted(steps)


class _EvaluatorView:
    """The `TrainerView` the evaluator gives `BestCheckpoint`: the training's model_dir, the
    evaluator's summary writers and the checkpoint it restores into."""

    def __init__(self, evaluator: Evaluator):
        self.model, self.optimizer = evaluator.model, evaluator.optimizer
        self.optimizers = {"optimizer": evaluator.optimizer}
        self.strategy, self.summaries = evaluator.strategy, evaluator.summaries
        self.checkpoint, self.model_dir = evaluator.reader.checkpoint, evaluator.model_dir
        self.target_step: int | None = None
        self.stop_training = False
        self._evaluator = evaluator

    @property
    def step(self) -> int:
        return self._evaluator.step

    def evaluates_after(self, step: int) -> bool:
        return False  # The evaluator evaluates checkpoints, not loops.

    def averaged_weights(self):
        return self._evaluator.averaged_weights()
