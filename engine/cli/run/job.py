"""A whole training job from a `RunConfig`: what `engine.main` runs.

Separate from `main.py` so tests and benchmarks can run a job in-process
without absl flag parsing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from engine import diagnostics
from engine import model_dir as model_dir_lib
from engine.callbacks.progress import format_logs, human_number
from engine.checkpointing import checkpointer as checkpoint_lib
from engine.checkpointing import discovery, repairs
from engine.cli.config.config_files import check_stored_config_writable, write_stored_config
from engine.cli.config.settings import RunConfig, trainer_options
from engine.cli.config.settings.cluster import resolve_multi_host
from engine.cli.config.settings.sections import NumericSettings, ProblemSettings, StateSettings
from engine.cli.process import host_memory
from engine.cli.process.own_packages import own_package
from engine.cli.process.preemption import stop_on_signals
from engine.cli.run import evaluator, inputs_record, predictor
from engine.cli.run.assembly import build_model_and_optimizer, prepare_process
from engine.cli.run.hooks_from_flags import hooks_from_config
from engine.cli.run.hparams import write_hparams
from engine.cli.run.model_summary import model_summary
from engine.cli.run.run_record import read_record, record_path, record_training
from engine.cli.run.run_task import RunTask, check_reported, resolve_task
from engine.cluster import task_model_dir
from engine.cluster.multi_host import MultiHostOptions
from engine.cluster.peer_loss import PEER_LOST_ERRORS, peer_lost_message
from engine.data import with_service
from engine.data_service import wait_for_dispatcher
from engine.errors import STOPPED_BY_PEER_EXIT, PeerLostError, UserError, one_line
from engine.export import check_export_dir, export_for_serving
from engine.goodput import restarts_from_environment
from engine.layers import describe_tables
from engine.logger import EVERY_TASK, message_width, wrap_line
from engine.resident import ResidentData
from engine.strategy import build_strategy
from engine.trainer import Trainer

BANNER_WIDTH = 80  # The banner's lines where they go to no terminal (a file, a pipe).


def run(
    config: RunConfig, multi_host: MultiHostOptions | None = None, *, started_at: float | None = None
) -> dict[str, Any]:
    """Trains and evaluates as `config` says, in the cluster `multi_host` (as `engine.main`
    resolved it; None: resolved here, for callers without it); returns what metrics.json holds.

    `started_at` (`time.time()`; default: now) is where the run's goodput clock starts:
    `engine.main` passes its process's start, so that start-up counts.

    A run stopped by SIGTERM/SIGINT saves a checkpoint, skips the final
    evaluation and metrics.json, and returns its `exit_status` (128+signal;
    75 on the other workers of a multi-worker run, which stop with it).

    Its UserErrors name flags: those of the library it calls (which name the
    library's arguments) are translated (`engine.cli.config.flag_names`).
    """
    from engine.cli.config.flag_names import errors_in_flag_terms

    started_at = time.time() if started_at is None else started_at
    with errors_in_flag_terms():
        multi_host = resolve_multi_host(config) if multi_host is None else multi_host
        with _peer_loss_before_training_is_one_line(multi_host):
            return _run(config, multi_host, started_at)


@contextlib.contextmanager
def _peer_loss_before_training_is_one_line(multi_host: MultiHostOptions) -> Iterator[None]:
    """A peer that ends while this task builds or restores its model is one line, as one lost
    mid-training is (`_train`): a chief refused in one line (its model_dir in use by another
    run) left the other workers in a collective broadcast that never came, each ending in a
    45-line UnavailableError traceback."""
    try:
        yield
    except PEER_LOST_ERRORS as error:
        cluster, timeout = multi_host.cluster, multi_host.heartbeat_timeout
        message = peer_lost_message(error, cluster, heartbeat_timeout=timeout, kept="it stopped before training")
        if message is None:
            raise
        raise PeerLostError(message) from None


def _run(config: RunConfig, multi_host: MultiHostOptions, started_at: float) -> dict[str, Any]:
    for flag in ("export_dir", "predict_output"):  # --model_dir's: RunConfig's check of its name.
        model_dir_lib.check_path_length(getattr(config, flag) or "", flag)
    if config.mode == "predict":  # Reads a trained model_dir, writes the --predict_output file only.
        return predictor.run(config)
    evaluation_mode = evaluator.evaluation_mode(config.mode, multi_host.cluster)
    if evaluation_mode is not None:  # --mode=eval/continuous_eval or an evaluator task: never trains.
        return evaluator.run(config, evaluation_mode)
    prepare_process(config.devices, config.numerics)
    if config.check_numerics:
        tf.debugging.enable_check_numerics()  # Names the first op that makes a NaN or Inf.
    strategy = build_strategy(
        config.strategy, cpu_devices=config.cpu_devices, num_gpus=config.num_gpus, multi_host=multi_host
    )
    cluster = multi_host.cluster
    if config.jit_compile and not tf.config.list_logical_devices("GPU"):
        logging.warning(
            "--jit_compile on a host without GPUs: XLA's CPU kernels ran the cnn "
            "5-7x slower than TensorFlow's oneDNN kernels here (benchmarks/RESULTS.md)"
        )
    task = resolve_task(config.problem)
    check_reported(config.decisions, task)
    source = task.source
    check_batch_fits(config.global_batch_size, source.num_train_examples, config.dataset)
    workers = cluster.num_workers if cluster else 1
    check_batch_fits_memory(config.global_batch_size, workers, source.feature_shape)
    model_dir = config.model_dir or tempfile.mkdtemp(prefix="engine-")
    model_dir_lib.check_name(model_dir)
    model_dir_lib.check_kinds(model_dir)
    if config.export_dir:
        check_export_dir(config.export_dir, model_dir)
    # Only the chief writes model_dir; other workers write a private copy they remove.
    write_dir = task_model_dir(model_dir, cluster)
    total_steps = config.total_steps(source.num_train_examples)
    # One writer per model_dir (the chief); readers such as an evaluator take no lock.
    lock = model_dir_lib.writer_lock(model_dir) if write_dir == model_dir else contextlib.nullcontext()
    # Repairs of on-disk state made while checking are undone if a later check refuses the run.
    with (
        model_dir_lib.disk_full_is_a_user_error(model_dir),
        lock,
        model_dir_lib.lost_directory_is_a_user_error(model_dir) as watch,
        repairs.undone_on_error(),
    ):
        job = TrainingJob(
            config, strategy, multi_host, task, model_dir, write_dir, total_steps, started_at, watch
        )
        return job.run()


def check_batch_fits(global_batch_size: int, num_train_examples: int | None, dataset: str) -> None:
    """A global batch larger than the train split would repeat examples within a
    batch (and an in-memory pipeline would build it at that size in memory)."""
    if num_train_examples is not None and global_batch_size > num_train_examples:
        raise UserError(
            f"--global_batch_size={global_batch_size} is larger than the {num_train_examples} "
            f"examples of --dataset={dataset}'s train split; use at most {num_train_examples}"
        )


def check_batch_fits_memory(global_batch_size: int, num_workers: int, feature_shape: tuple[int, ...]) -> None:
    """This host's share of a batch of float32 examples must fit in half the memory this
    process may use (tf.data prefetches more than one), checked before anything is allocated:
    where the data's size is unknown (tfrecord) nothing else stops an absurd batch before it crashes."""
    limit = host_memory.memory_limit_bytes()
    example_bytes = math.prod(feature_shape) * 4 + 4  # float32 features, an int32 label
    batch_bytes = global_batch_size // max(1, num_workers) * example_bytes
    if limit is not None and batch_bytes > limit // 2:
        most = limit // 2 // example_bytes * max(1, num_workers)
        raise UserError(
            f"--global_batch_size={global_batch_size} needs {batch_bytes / 2**30:.1f} GiB per batch of "
            f"{feature_shape} float32 examples on this host, more than half of the {limit / 2**30:.1f} GiB "
            f"this process may use; use at most {most}"
        )


@dataclasses.dataclass
class TrainingJob:
    """The part of `run` that reads and writes model_dir (under the writer lock on the chief),
    a method per phase: check the model_dir, build the Trainer, write the run's records, train,
    report. Everything is checked before the first byte is written; `watch` tells whether the
    model_dir is still the one the run began with."""

    config: RunConfig
    strategy: tf.distribute.Strategy
    multi_host: MultiHostOptions
    task: RunTask
    model_dir: str
    write_dir: str  # model_dir on the chief; a private copy on another worker.
    total_steps: int
    started_at: float
    watch: model_dir_lib.DirectoryWatch
    trainer: Trainer = dataclasses.field(init=False)
    model: Any = dataclasses.field(init=False)

    @property
    def writes_model_dir(self) -> bool:
        return self.write_dir == self.model_dir

    @property
    def metrics_path(self) -> str:
        return record_path(self.model_dir)

    def run(self) -> dict[str, Any]:
        """Trains and evaluates; what metrics.json holds (or the exit status of a stopped run)."""
        if self.writes_model_dir:
            self.check_model_dir()
        evaluates = self.build_trainer()
        finished = (
            _finished_result(self.trainer, self.total_steps, self.metrics_path)
            if self.writes_model_dir
            else None
        )
        # Synchronous workers evaluate together, so there the chief evaluates again with them
        # and keeps the train part of metrics.json; everywhere else a finished run does nothing.
        if finished is not None and self.config.strategy != "multi_worker_mirrored":
            return self.nothing_to_train(finished)
        repairs.keep()  # Everything is checked: the repairs stay, the first bytes are written.
        # (The Trainer removed the partial folders of saves cut short by kill -9 or a full disk.)
        if self.strategy.extended.should_checkpoint:
            self.write_records()
        outcome = self.train(evaluates)
        if isinstance(outcome, int):  # Stopped by a signal or a peer: a checkpoint, no results.
            return {"global_step": self.trainer.step, "exit_status": outcome}
        train_logs, eval_logs = outcome
        if finished is not None and not train_logs:
            train_logs = finished.get("train") or {}
        return self.report(train_logs, eval_logs)

    def check_model_dir(self) -> None:
        """What the chief will write, checked (and what a crash left, recovered) before any write."""
        config, model_dir, metrics_path = self.config, self.model_dir, self.metrics_path
        if tf.io.gfile.isdir(metrics_path):
            raise UserError(f"{metrics_path} is a directory; move it away, the run writes its results there")
        read_record(model_dir)  # Damaged: refused now, not after training.
        check_stored_config_writable(model_dir)
        inputs_record.check_writable(model_dir)
        discovery.recover_state(checkpoint_lib.checkpoint_dir(model_dir))
        checkpoint_lib.check_settings(
            model_dir, _optimizer_settings(config), flags_may_change=config.reset_optimizer
        )

    def build_trainer(self) -> bool:
        """The model, its optimizer, the data and the Trainer over them (restored from the latest
        checkpoint); whether the run evaluates."""
        config, strategy, task, model_dir, write_dir = (
            self.config,
            self.strategy,
            self.task,
            self.model_dir,
            self.write_dir,
        )
        model, optimizer = build_model_and_optimizer(config.optimization, strategy, task, self.total_steps)
        source = task.source

        if config.data_service is not None:  # Bounded: TensorFlow's client waits for it without end.
            wait_for_dispatcher(config.data_service, config.startup_timeout)
        train_data, eval_data = train_and_eval_data(config, source)
        batch = config.global_batch_size
        if write_dir != model_dir:  # A restarted worker's scratch from the run it died in.
            model_dir_lib.remove_tree(write_dir)
        trainer_class = Trainer
        if config.strategy == "parameter_server":
            from engine.trainer.coordinated import CoordinatedTrainer as trainer_class
        trainer = trainer_class(
            strategy=strategy,
            model=model,
            optimizer=optimizer,
            train_data=train_data,
            eval_data=eval_data,
            global_batch_size=batch,
            model_dir=write_dir,
            callbacks=hooks_from_config(config.decisions, config.summaries),
            ema_decay=config.ema_decay or None,
            **task.trainer_arguments(model),
            **trainer_options(  # The option groups, from the settings of their options' names.
                config,
                restore_dir=model_dir if write_dir != model_dir else None,
                steps_per_epoch=max(1, source.num_train_examples // batch)
                if source.num_train_examples
                else None,
                flops_per_example=own_package("models").known_flops_per_example(model),  # None: not counted.
            ),
        )
        trainer.goodput_clock.start_from(self.started_at)  # Start-up counts from the process's start.
        trainer.reports_goodput = False  # Once, after the final evaluation (_train_with_clean_errors).
        _log_banner(config, strategy, model, task, model_dir, self.total_steps, trainer)
        self.trainer, self.model = trainer, model
        return eval_data is not None

    def nothing_to_train(self, finished: dict[str, Any]) -> dict[str, Any]:
        """A rerun of a finished run: its export (of the finished run's weights) if asked, nothing else."""
        _export_if_asked(self.config.state, self.strategy, self.trainer, self.model, self.task)
        self.trainer.close()
        logging.info(
            "the run is already at step %d (the target is %d): nothing to train; %s left as it was; "
            "raise --train_steps or --epochs to continue",
            self.trainer.step,
            self.total_steps,
            self.metrics_path,
        )
        return finished

    def write_records(self) -> None:
        """The chief's first writes: the hparams, the optimizer's settings, the settings a rerun,
        --mode=eval or --mode=predict with only --model_dir rebuilds the model from, its inputs."""
        config, model_dir = self.config, self.model_dir
        write_hparams(model_dir, config.settings())
        checkpoint_lib.record_settings(model_dir, _optimizer_settings(config))
        write_stored_config(model_dir, config)
        inputs_record.write(model_dir, self.task, config.label_column)

    def train(self, evaluates: bool) -> tuple[dict[str, float], dict[str, float]] | int:
        """Trains and evaluates (`_train_with_clean_errors`), then exports if asked; a worker's
        private model_dir is removed whatever happens."""
        config, trainer, write_dir = self.config, self.trainer, self.write_dir
        # A frozen ps task: one line and 69, not a hang.
        with _watch_ps_tasks(config.strategy, self.multi_host, write_dir):
            try:
                outcome = _train_with_clean_errors(
                    config,
                    self.multi_host,
                    self.strategy,
                    self.task.source,
                    trainer,
                    self.total_steps,
                    evaluates=evaluates,
                    model_dir=self.model_dir,
                )
            finally:
                if write_dir != self.model_dir:
                    model_dir_lib.remove_tree(write_dir)
                    # The shared parent, once the last worker is done.
                    model_dir_lib.remove_if_empty(os.path.dirname(write_dir))
            if not isinstance(outcome, int):
                _export_if_asked(config.state, self.strategy, trainer, self.model, self.task)
        return outcome

    def report(self, train_logs: dict[str, Any], eval_logs: dict[str, Any]) -> dict[str, Any]:
        """The run's results: recorded in metrics.json by the chief, and its `done:` line."""
        trainer, model_dir = self.trainer, self.model_dir
        speed = trainer.steady_examples_per_second or train_logs.get("examples_per_second")
        result = {
            "global_step": trainer.step,
            "train": train_logs,
            "eval": eval_logs,
            "examples_per_second": speed,
            "goodput": trainer.last_goodput,
            "model_dir": model_dir,
        }
        if trainer.stragglers is not None:  # Each worker's compute and input wait per step, in the last loop.
            result.update(trainer.stragglers.watch.last)
        if (
            self.config.on_nonfinite == "rollback" or trainer.rollbacks
        ):  # Loss spikes survived (engine.loop.rollback).
            result["rollbacks"] = trainer.rollbacks
        if self.writes_model_dir:
            model_dir_lib.check_still_there(self.watch)  # Not a new model_dir holding only metrics.json.
            result = record_training(model_dir, result, mode=self.config.mode)
        wrote = self.metrics_path if self.writes_model_dir else "nothing (not the chief)"
        digest = "" if self.multi_host.cluster is None else f"; weights_digest={_weights_digest(self.model)}"
        line = (
            f"done: step {trainer.step}, eval {format_logs(eval_logs) if eval_logs else 'none'}, "
            f"{human_number(speed or 0.0)} examples/s; wrote {wrote}{digest}"
        )
        # Every worker prints it: their digests, to compare.
        logging.info("%s", wrap_line(line, message_width()), extra=EVERY_TASK)
        return result


def _export_if_asked(
    state: StateSettings, strategy: tf.distribute.Strategy, trainer: Trainer, model: Any, task: RunTask
) -> None:
    """`--export_dir`: the SavedModel of the trained weights (the averages under `--ema_decay`:
    the model to serve), written by the chief alone."""
    if not state.export_dir or not strategy.extended.should_checkpoint:
        return
    table = getattr(task.source, "table", None)
    if table is not None:  # Raw named columns in, the encoding inside (and a .keras beside).
        from engine.cli.run.table_export import export_table

        with trainer.averaged_weights():
            export_table(model, state.export_dir, table, task.source.labels.kind)
        return
    with trainer.averaged_weights():
        export_for_serving(
            model,
            state.export_dir,
            input_shape=task.input_shape,
            input_dtype=task.source.feature_dtype,
            label_kind=task.source.labels.kind,
        )


def train_and_eval_data(config: RunConfig, source) -> tuple[Any, Any]:
    """The Trainer's train_data and eval_data (None: no evaluation) from `source`, in the
    form --input_pipeline asks for, or kept on the devices where --device_data_mb allows."""
    batch, seed = config.global_batch_size, config.seed
    if config.input_pipeline == "global":

        def global_train_data(start_step):
            return source.train_dataset(global_batch_size=batch, seed=seed, start_step=start_step)

        # The trainer tells the two kinds apart by their parameters (input_context or not).
        train_data: Callable[..., tf.data.Dataset] | ResidentData = global_train_data

        eval_data = source.eval_dataset(global_batch_size=batch)
    else:

        def per_worker_train_data(input_context, start_step):
            return source.train_dataset(
                global_batch_size=batch, seed=seed, start_step=start_step, input_context=input_context
            )

        train_data = per_worker_train_data

        eval_data = None
        if source.num_eval_examples is not None:

            def eval_data(input_context):
                return source.eval_dataset(global_batch_size=batch, input_context=input_context)

    service = config.cluster.data_service_option()
    if service is not None:  # The batches come from the service's workers: nothing to keep on the devices.
        return with_service(train_data, service), (None if config.mode == "train" else eval_data)
    resident = resident_train_data(
        source, global_batch_size=batch, seed=seed, device_data_mb=config.device_data_mb, host_data=train_data
    )
    if resident is not None:
        train_data = resident
    if config.mode == "train":
        eval_data = None
    elif resident is not None and eval_data is not None:
        left_mb = config.device_data_mb - resident.num_bytes / 2**20
        eval_data = resident_eval_data(
            source, global_batch_size=batch, device_data_mb=left_mb, host_data=eval_data
        )
    return train_data, eval_data


def _train_with_clean_errors(
    config: RunConfig,
    multi_host: MultiHostOptions,
    strategy,
    source,
    trainer: Trainer,
    total_steps: int,
    *,
    evaluates: bool,
    model_dir: str,
) -> tuple[dict[str, float], dict[str, float]] | int:
    """Trains to `total_steps` and evaluates; (train logs, eval logs), or the exit status of a
    run stopped by a signal or a peer worker. Errors of the data or the memory the run meets
    mid-run become one line naming what is kept."""
    cluster = multi_host.cluster
    task_type, task_index = (cluster.task_type, cluster.task_index) if cluster else (None, None)
    # Where SIGUSR1 (and a lost peer) write this task's report: engine.diagnostics.
    task = diagnostics.task_name(task_type, task_index)
    report_to = (os.path.join(model_dir, diagnostics.DIAGNOSTICS_DIR), task)
    with stop_on_signals(trainer, diagnostics=report_to) as signal_record:
        try:
            train_logs = trainer.train(total_steps)
            eval_logs = trainer.evaluate_current() if evaluates and not trainer.stop_agreed else {}
        except tf.errors.DataLossError as error:  # A record whose bytes fail their CRC, read mid-run.
            message = damaged_data_message(config.problem, source, error, _what_is_kept(trainer))
            if message is None:
                raise
            trainer.close()
            raise UserError(message) from None
        except tf.errors.ResourceExhaustedError as error:  # Disk-full ones are save()'s, not this.
            message = out_of_memory_message(config, strategy, error, _what_is_kept(trainer))
            if message is None:
                raise
            trainer.close()
            raise UserError(message) from None
        except PEER_LOST_ERRORS as error:  # A frozen, partitioned or dead peer of the cluster.
            message = peer_lost_message(
                error, cluster, heartbeat_timeout=multi_host.heartbeat_timeout, kept=_what_is_kept(trainer)
            )
            if message is None:
                raise
            message += _report_on_the_way_out(report_to, trainer, message)
            trainer.close()
            raise PeerLostError(message) from None
        except tf.errors.InvalidArgumentError as error:
            text = _tf_error_line(error, "label")
            if text is None:
                raise
            assertion = re.search(r"assertion failed: \[([^\]]*label[^\]]*)\]", error.message or "")
            text = assertion.group(1) if assertion else text  # The data check's own words.
            trainer.close()
            raise UserError(
                f"bad data in --dataset={config.dataset} --data_dir={config.data_dir}: {text}; "
                f"fix or remove that file; {_what_is_kept(trainer)}"
            ) from None
        except Exception:
            _end_background_write(trainer)
            raise
    # The goodput scalars and line, after the final evaluation; metrics.json takes the same (last_goodput).
    trainer.report_goodput(restarts_from_environment())
    trainer.close()
    if trainer.stop_agreed:
        cause = (
            f"signal {signal_record.signum}"
            if signal_record.signum is not None
            else "a stop request from another worker"
        )
        logging.warning(
            "stopped at step %d by %s; checkpoint saved in %s; rerun the same command to continue",
            trainer.step,
            cause,
            model_dir,
        )
        return signal_record.exit_status or STOPPED_BY_PEER_EXIT
    return train_logs, eval_logs


def _report_on_the_way_out(report_to: tuple[str, str], trainer: Trainer, why: str) -> str:
    """Writes this task's diagnostics report (engine.diagnostics: its last completed step, its
    threads) as it ends on `why`, and returns "; <where it is>" for its last line; "" where it
    cannot be written (the line under way says the cause; the report is extra)."""
    directory, task = report_to
    try:
        text = diagnostics.report({**trainer.progress(), "ended": why}, task=task)
        path = diagnostics.write_report(directory, task, text)
    except (OSError, tf.errors.OpError):
        return ""
    return f"; its last step and stacks: {path}"


def _end_background_write(trainer: Trainer) -> None:
    """On the way out with an error: waits for a checkpoint still being written, so that its own
    failure (most often the same full disk) is not reported a second time, at exit."""
    if trainer.checkpointer is None:
        return
    try:
        trainer.checkpointer.wait()
    except UserError:
        pass  # The same cause as the error under way, whose one line says it.
    except Exception as error:  # Another failure: said once, beside the error under way.
        logging.warning("the checkpoint written in the background failed too: %s", one_line(error, 200))


def _watch_ps_tasks(
    strategy: str, multi_host: MultiHostOptions, write_dir: str
) -> contextlib.AbstractContextManager[Any]:
    """On a parameter-server run's chief: a PsWatch over its ps tasks, bounded by
    --heartbeat_timeout (engine.cluster.ps_watch); elsewhere nothing."""
    cluster = multi_host.cluster
    if strategy != "parameter_server" or cluster is None or cluster.task_type != "chief":
        return contextlib.nullcontext()
    from engine.cluster.ps_watch import PsWatch

    def kept() -> str:  # From the disk: the Checkpointer's own answer may wait on the frozen task.
        latest = discovery.latest_checkpoint(checkpoint_lib.checkpoint_dir(write_dir))
        if latest is None:
            return "stopped without saving (no checkpoint yet)"
        return f"stopped without saving, the latest checkpoint ({latest}) is kept"

    ps = [(name, address) for name, address in cluster.peers() if name.startswith("ps:")]
    me = f"{cluster.task_type}:{cluster.task_index}"
    return PsWatch(me, ps, timeout=multi_host.heartbeat_timeout, kept=kept)


def _what_is_kept(trainer: Trainer) -> str:
    """How a run that stops on an error ends: it saves nothing after the error."""
    # The Checkpointer's: it waits for a checkpoint still being written in the background.
    latest = trainer.checkpointer.latest if trainer.checkpointer is not None else None
    if latest is None:
        return "stopped without saving (no checkpoint yet)"
    return f"stopped without saving, the latest checkpoint ({latest}) is kept"


def _tf_error_line(error: tf.errors.OpError, key: str) -> str | None:
    """The line of a TF error that holds `key`, without its '{{function_node ...}}' and
    '[Op:...]' parts; None if no line does. A compiled call's error starts with "Graph
    execution error:" and the Python stack where the op was defined, TF's own text after it."""
    for line in (error.message or "").splitlines():
        if key in line and not line.startswith(" "):  # Not a line of the stack (or a file named in it).
            line = re.sub(r"\{\{[^}]*\}\}\s*", "", line)
            return one_line(re.sub(r"\s*\[Op:.*$", "", line), 200)
    return None


def _some(paths: tuple[str, ...], shown: int = 5) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def damaged_data_message(
    problem: ProblemSettings, source, error: tf.errors.DataLossError, kept: str
) -> str | None:
    """One line for a data file whose record fails its checksum mid-run (its framing was
    checked at start-up, its bytes were not: that would read the whole data set); None for
    a DataLossError that is not a data file's (a damaged checkpoint keeps its traceback)."""
    text = _tf_error_line(error, "record at ")  # "corrupted record at 9352"
    damaged_files = getattr(source, "damaged_files", None)
    if damaged_files is None or text is None:
        return None
    files = damaged_files(str(error))
    where = f"TFRecord file {files[0]}" if len(files) == 1 else f"one of the TFRecord files {_some(files)}"
    return (
        f"damaged data in {where} ({text}); copy the file again or remove it from "
        f"--data_dir={problem.data_dir}; {kept}"
    )


def out_of_memory_message(
    config: RunConfig, strategy, error: tf.errors.ResourceExhaustedError, kept: str
) -> str | None:
    """One line for a device or host allocation that failed inside the compiled step
    (TF's "OOM when allocating"); None for other exhausted resources (a full disk)."""
    text = _tf_error_line(error, "OOM when allocating")
    if text is None:
        return None
    replicas = strategy.num_replicas_in_sync
    per_replica = config.global_batch_size // replicas
    accumulate = config.grad_accum_steps
    micro = per_replica // accumulate
    return (
        f"out of memory training --model={config.model} at --global_batch_size={config.global_batch_size} "
        f"({micro} examples per micro-batch on each of {replicas} replica(s), {accumulate} micro-batch(es) "
        f"a step): {text}; use a smaller --global_batch_size, or a larger "
        f"--grad_accum_steps (the same batch in smaller micro-batches); {kept}"
    )


def resident_eval_data(source, *, global_batch_size: int, device_data_mb: float, host_data: Any) -> Any:
    """The eval split as `ResidentEvalData` (kept on every replica's device beside the train
    split) where the source holds it in memory and it fits in what is left of --device_data_mb;
    else `host_data`, the eval form it streams through tf.data."""
    resident = source.resident_eval_data(global_batch_size=global_batch_size, host_data=host_data)
    if resident is None:
        return host_data
    if resident.num_bytes / 2**20 > device_data_mb:
        logging.info("eval split does not fit beside the train split in --device_data_mb: streaming it")
        return host_data
    return resident


def resident_train_data(
    source, *, global_batch_size: int, seed: int, device_data_mb: int, host_data: Any
) -> ResidentData | None:
    """The train split as `ResidentData` (kept on every replica's device) where the
    source holds it in memory and one copy fits in `device_data_mb` MiB; None
    otherwise. `host_data` is what strategies that cannot keep it train from."""
    if device_data_mb == 0:
        return None
    resident = source.resident_train_data(global_batch_size=global_batch_size, seed=seed)  # Nothing copied yet.
    if resident is None:
        return None
    size_mb = resident.num_bytes / 2**20
    if size_mb > device_data_mb:
        logging.info(
            "train split of %.0f MiB > --device_data_mb=%d: streaming it through tf.data",
            size_mb,
            device_data_mb,
        )
        return None
    return dataclasses.replace(resident, host_data=host_data)


def _weights_digest(model) -> str:
    """A fingerprint of the weights: equal on every worker of a synchronous run."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()[:16]


def _log_banner(config, strategy, model, task: RunTask, model_dir, total_steps, trainer: Trainer) -> None:
    """What the run is, a line a concern, each broken between its fields to the terminal's width (80
    columns into a file or a pipe), then Keras's summary of the model."""
    source = task.source
    replicas = strategy.num_replicas_in_sync
    try:
        devices = [short_device_name(device) for device in strategy.extended.worker_devices]
    except RuntimeError:  # The default strategy has no device list.
        devices = ["default device"]
    kept = _input_place(config, trainer)
    examples = f"{human_number(source.num_train_examples)} train / {human_number(source.num_eval_examples)} eval"
    lines = [
        f"strategy={config.strategy}  replicas={replicas}  devices={','.join(devices)}",
        f"global_batch={config.global_batch_size}  per_replica_batch={config.global_batch_size // replicas}  "
        f"precision={_precision(config.numerics, trainer)}",
        f"model={task.model_name}  params={human_number(model.count_params())}",
        f"dataset={config.task or config.dataset}  {examples}  {kept}  examples {tuple(source.feature_shape)}",
        re.sub(r" (?=\w+=)", "  ", task.describe()),  # Its `key=value`s apart, to break between.
        f"steps={trainer.step}->{total_steps}  model_dir={model_dir}",
    ]
    width = message_width() or BANNER_WIDTH
    logging.info("%s", "\n".join(wrap_line(line, width) for line in lines))
    table = getattr(source, "table", None)  # A table read by its columns' types (input.tables).
    for line in table.describe() if table is not None else ():
        logging.info("%s", line)
    if table is None and task.feature_columns is not None:  # A CSV of numbers alone.
        logging.info("%s", _numbers_line(task.feature_columns))
    logging.info("model %s:\n%s", task.model_name, model_summary(model))
    for line in describe_tables(model):  # Where each engine.ShardedEmbedding's shards live.
        logging.info(line)


def short_device_name(device: str) -> str:
    """`CPU:0` for this process's `/job:localhost/replica:0/task:0/device:CPU:0`, `worker:1/GPU:0` for a
    cluster's: the banner's devices fit a line."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type is None:
        return device
    name = f"{spec.device_type}:{spec.device_index or 0}"
    if spec.job in (None, "localhost"):
        return name
    return f"{spec.job}:{spec.task or 0}/{name}"


def _numbers_line(columns: tuple[str, ...], width: int = 78) -> str:
    """`columns: 10 numbers (age, sex, bmi, ...)`, within `width` where the first name allows."""
    head = f"columns: {len(columns)} number{'' if len(columns) == 1 else 's'}"
    shown: list[str] = []
    for name in columns:
        if shown and len(f"{head} ({', '.join([*shown, name])}, ...)") > width:
            break
        shown.append(name)
    return f"{head} ({', '.join(shown)}{', ...' if len(shown) < len(columns) else ''})"


def _input_place(config: RunConfig, trainer: Trainer) -> str:
    """Where the training batches come from, for the banner."""
    if trainer.keeps_data_on_devices:
        return "kept on the devices"
    service = config.cluster.data_service_option()
    return "through tf.data" if service is None else service.describe()


def _precision(numerics: NumericSettings, trainer: Trainer) -> str:
    """The compute precision, and the loss scale float16 trains under (`engine.precision`)."""
    scaled = isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    return numerics.mixed_precision + ("+dynamic_loss_scale" if scaled else "")


def _optimizer_settings(config: RunConfig) -> dict[str, str]:
    """The flags whose change makes a checkpoint's optimizer state wrong or unreadable."""
    return {
        "optimizer": config.optimizer,
        "lr_schedule": config.lr_schedule,
        "mixed_precision": config.mixed_precision,
        "ema_decay": str(config.ema_decay),
    }


def _finished_result(trainer: Trainer, total_steps: int, metrics_path: str) -> dict[str, Any] | None:
    """What metrics.json holds when a rerun has nothing left to do; None when
    there is work (steps to train, or a final evaluation that never got written)."""
    if trainer.step < total_steps:
        return None
    previous = model_dir_lib.read_json(metrics_path, what="the results of the run")
    if not isinstance(previous, dict) or previous.get("global_step") != trainer.step:
        return None
    # The record's figures, but where the model_dir is now (a copied one names where it was
    # written) and no exit status of its own: what a model_dir holds is data, not this run's end.
    previous.pop("exit_status", None)
    return {**previous, "model_dir": os.path.dirname(metrics_path)}
