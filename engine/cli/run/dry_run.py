"""`engine.main --dry_run`: a cluster's config checked on one machine before it costs a cluster.

A 16-worker config that fails does so after the cluster has started: a global batch that does
not divide over the replicas, a model that does not fit, a model that does not take the data.
Each can be found in seconds on one machine. The dry run simulates the cluster's replicas as
logical CPU devices of this process: multi_worker_mirrored's N workers x R replicas as one
MirroredStrategy over N x R devices (the same per-replica batch, the same all-reduced sums), a
parameter-server worker as its own R replicas (each worker's step takes whole global batches).
It builds the model, runs one batch through one compiled step, and reports the batch split,
the memory per replica and per ps task (with each table shard's part of the step), and the
checkpoint's size. A `--ps_shards` the tables cannot take is refused as the model builds.

It writes nothing: the model_dir is read (its stored config, as a rerun would be), never
written; no port is opened, no peer contacted. Every problem is one line; any problem, exit 2.
Left unchecked, and said so: activations (the step's working memory beyond its state) and a
GPU's own memory, which a CPU cannot measure.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import traceback
from typing import Any

import tensorflow as tf
from absl import logging

from engine.cli.config.settings import RunConfig, trainer_options
from engine.cli.config.settings.sections import OptimizationSettings
from engine.cli.process import host_memory
from engine.cli.process.environment import seed_everything
from engine.cli.run.assembly import build_optimizer, prepare_process
from engine.cli.run.job import check_batch_fits, train_and_eval_data
from engine.cli.run.run_task import RunTask, check_reported, resolve_task
from engine.cli.run.table_shards import SHARD_STEP_BYTES
from engine.cluster import Cluster
from engine.cluster.multi_host import MultiHostOptions
from engine.errors import USER_ERROR_EXIT, UserError, one_line
from engine.layers import sharded_tables
from engine.options import CheckpointOptions
from engine.schedules import learning_rate_schedule
from engine.strategy import build_strategy
from engine.trainer import Trainer
from engine.variables import all_variables, trainable_variables

# The most replicas the one step runs on in this process: past it, each simulated replica still
# gets its own per-replica batch, on this many of them (a 128-replica step is 128 model copies).
MAX_SIMULATED_REPLICAS = 16
# Optimizer slots per trainable weight, to size the state before the optimizer exists.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
PREFIX = "dry run: "


@dataclasses.dataclass(frozen=True)
class SimulatedCluster:
    """The replicas a config runs on, as the dry run simulates them."""

    strategy: str
    workers: int  # Training workers (a multi-worker chief counts as one); 1 on one host.
    replicas_per_worker: int  # Its GPUs, else its CPU devices (mirrored) or 1.
    ps_tasks: int  # parameter_server only; else 0.
    source: str  # Where the cluster's shape came from, for the report.

    @property
    def replicas_in_sync(self) -> int:
        """The replicas one step's global batch is split over: a parameter-server worker's step
        is its own; the other strategies split it over every worker's replicas."""
        if self.strategy == "parameter_server":
            return self.replicas_per_worker
        return self.workers * self.replicas_per_worker

    def describe(self) -> str:
        replicas = f"{self.replicas_per_worker} replica{'s' if self.replicas_per_worker > 1 else ''}"
        if self.strategy == "parameter_server":
            workers = f"{self.workers} worker(s) x {replicas} each, {self.ps_tasks} ps task(s)"
            return f"parameter_server, {workers} ({self.source})"
        if self.workers > 1 or self.strategy == "multi_worker_mirrored":
            workers = f"{self.workers} worker(s) x {replicas} = {self.replicas_in_sync}"
            return f"{self.strategy}, {workers} ({self.source})"
        return f"{self.strategy}, {replicas} ({self.source})"


def simulated_cluster(config: RunConfig, cluster: Cluster | None) -> SimulatedCluster:
    """The cluster `config` describes: --dry_run_workers/--dry_run_ps, else `cluster` (the one its
    cluster flags or TF_CONFIG give)."""
    per_worker = config.num_gpus or (config.cpu_devices if config.strategy == "mirrored" else 1)
    if config.strategy not in ("multi_worker_mirrored", "parameter_server"):
        return SimulatedCluster(config.strategy, 1, per_worker, 0, "one host")
    if config.simulates_a_cluster:
        ps_tasks = (config.dry_run_ps or 1) if config.strategy == "parameter_server" else 0
        return SimulatedCluster(
            config.strategy, config.dry_run_workers, per_worker, ps_tasks, "--dry_run_workers"
        )
    if cluster is None:  # multi_worker_mirrored alone on this host (parameter_server refused it).
        return SimulatedCluster(config.strategy, 1, per_worker, 0, "no cluster given: one worker")
    spec = cluster.training_spec()
    workers = len(spec.get("worker", ()))
    if config.strategy == "multi_worker_mirrored":
        workers += len(spec.get("chief", ()))  # Its chief trains as a worker too.
    return SimulatedCluster(config.strategy, workers, per_worker, len(spec.get("ps", ())), "the cluster's tasks")


def dry_run(config: RunConfig, multi_host: MultiHostOptions) -> int:
    """Checks `config` as its cluster (`multi_host`'s, or the one it simulates) would run it (see the
    module docstring); the exit status."""
    problems = _Problems()
    cluster = simulated_cluster(config, multi_host.cluster)
    logging.info("%s%s", PREFIX, cluster.describe())
    simulated = _simulated_replicas(config, min(cluster.replicas_in_sync, MAX_SIMULATED_REPLICAS))
    task = resolve_task(config.problem)
    check_reported(config.decisions, task)
    source = task.source
    batch, accumulation = config.global_batch_size, config.grad_accum_steps
    if batch % (cluster.replicas_in_sync * accumulation):
        problems.add(
            f"--global_batch_size={batch} does not divide over {cluster.replicas_in_sync} replica(s)"
            + (f" x --grad_accum_steps={accumulation}" if accumulation > 1 else "")
            + f"; use a multiple of {cluster.replicas_in_sync * accumulation}"
        )
    problems.check(check_batch_fits, batch, source.num_train_examples, config.dataset)
    per_replica_batch = batch // cluster.replicas_in_sync
    total_steps = config.total_steps(source.num_train_examples)

    # The state's size from one copy of the model, before any replica holds one.
    sizes = problems.check(_state_sizes, config.optimization, task)  # A model that cannot be built: a UserError.
    if sizes is not None:
        example_bytes = math.prod(source.feature_shape) * 4 + 4  # float32 features, an int32 label
        batch_bytes = per_replica_batch * example_bytes
        _check_memory(
            problems, cluster, sizes, batch_bytes, per_replica_batch, simulated, on_gpus=bool(config.num_gpus)
        )
    if not problems:
        step_args = (config, task, cluster, simulated, per_replica_batch, total_steps)
        problems.check(_one_step, *step_args, runs_user_code="the step")
    if config.num_gpus:
        logging.info(
            "%s%d GPU(s) per worker simulated on CPU devices: their memory is not checked",
            PREFIX,
            config.num_gpus,
        )
    return problems.report(config.model_dir)


@dataclasses.dataclass(frozen=True)
class StateSizes:
    """Bytes of the model's state, from one copy of it."""

    # (bytes, trainable) of each variable, in creation order (the ps tasks' round robin).
    variables: tuple[tuple[int, bool], ...]
    slots_per_weight: int
    shards: int = 0  # Variables of engine.ShardedEmbedding tables: each a gather and an update in the step.

    @property
    def shard_step(self) -> int:
        """The tables' shards' part of the step on a worker (engine.cli.run.table_shards, measured)."""
        return self.shards * SHARD_STEP_BYTES

    @property
    def weights(self) -> int:
        return sum(size for size, _ in self.variables)

    @property
    def trainable(self) -> int:
        return sum(size for size, trains in self.variables if trains)

    @property
    def slots(self) -> int:
        return self.trainable * self.slots_per_weight

    @property
    def checkpoint(self) -> int:
        return self.weights + self.slots

    def busiest_ps_task(self, ps_tasks: int) -> tuple[int, int]:
        """(task index, bytes) of the ps task holding the most: tf.distribute places a parameter-server
        run's variables round robin in creation order, each optimizer slot beside its variable."""
        held = [0] * max(1, ps_tasks)
        for index, (size, trains) in enumerate(self.variables):
            held[index % len(held)] += size * (1 + (self.slots_per_weight if trains else 0))
        most = max(held)
        return held.index(most), most


def _simulated_replicas(config: RunConfig, wanted: int) -> int:
    """Splits this host's CPU into `wanted` logical devices and sets the process up as a run would
    (precision, seeds); where TensorFlow already started with fewer (an embedding notebook, a
    test), the step runs on those: each replica still takes its own per-replica batch."""
    try:
        devices = config.devices
        prepare_process(
            dataclasses.replace(devices, cpu_devices=max(devices.cpu_devices, wanted)), config.numerics
        )
    except UserError:  # TensorFlow already started with fewer CPU devices.
        prepare_process(dataclasses.replace(config.devices, cpu_devices=1), config.numerics)
    return min(wanted, len(tf.config.list_logical_devices("CPU")))


def _check_memory(
    problems: _Problems,
    cluster: SimulatedCluster,
    sizes: StateSizes,
    batch_bytes: int,
    per_replica_batch: int,
    simulated: int,
    *,
    on_gpus: bool,
) -> None:
    """Reports the state's sizes; a worker or ps task that a host like this one cannot hold is a problem."""
    limit = host_memory.memory_limit_bytes()
    batch = f"a batch of {per_replica_batch} ({_size(batch_bytes)})"
    # A replica holding everything; the step's part per table shard is the worker's, once.
    whole_copy = sizes.weights + sizes.slots + sizes.trainable + batch_bytes + sizes.shard_step
    if sizes.shards:
        logging.info(
            "%s%d table shard variable(s) (engine.ShardedEmbedding, --ps_shards): about %s of the step on "
            "each worker (a gather, a gradient and an update each)",
            *(PREFIX, sizes.shards, _size(sizes.shard_step)),
        )
    if cluster.strategy == "parameter_server":  # The variables and their slots live on the ps tasks.
        replica = sizes.trainable + batch_bytes + sizes.shard_step
        logging.info(
            "%sper worker replica: gradients %s + %s = %s (activations come on top); on the ps tasks: "
            "weights %s + optimizer slots %s",
            *(PREFIX, _size(sizes.trainable), batch, _size(replica), _size(sizes.weights), _size(sizes.slots)),
        )
        busiest, most = sizes.busiest_ps_task(cluster.ps_tasks)
        logging.info("%sthe busiest ps task, ps:%d, holds %s", PREFIX, busiest, _size(most))
        if limit is not None and most > limit:
            problems.add(
                f"ps:{busiest} would hold {_size(most)} of variables and optimizer slots, more than the "
                f"{_size(limit)} a host like this one may use; add ps tasks (--dry_run_ps) or split the "
                "largest tables (engine.ShardedEmbedding)"
            )
    else:
        replica = whole_copy
        logging.info(
            "%sper replica: weights %s + optimizer slots %s + gradients %s + %s = %s (activations come on top)",
            *(PREFIX, _size(sizes.weights), _size(sizes.slots), _size(sizes.trainable), batch, _size(replica)),
        )
    logging.info("%scheckpoint about %s (weights and optimizer state)", PREFIX, _size(sizes.checkpoint))
    worker_needs = replica * cluster.replicas_per_worker
    if limit is not None and not on_gpus and worker_needs > limit:
        problems.add(
            f"a worker's {cluster.replicas_per_worker} replica(s) need {_size(worker_needs)} before "
            f"activations, more than the {_size(limit)} a host like this one may use; use a smaller "
            "model or batch, or more workers"
        )
    here = simulated * whole_copy  # Every simulated replica holds a whole copy in this process.
    if not problems and here > (limit or math.inf) // 2:
        problems.add(
            f"simulating {simulated} replicas needs {_size(here)}, more than half of this host's "
            f"{_size(limit or 0)}; run the dry run on a larger machine"
        )


def _state_sizes(optimization: OptimizationSettings, task: RunTask) -> StateSizes:
    with tf.distribute.get_strategy().scope():
        model = task.build_model()
    trainable = {id(variable) for variable in trainable_variables(model)}
    shards = sum(len(table.shards) for table in sharded_tables(model))
    return StateSizes(
        variables=tuple(
            (math.prod(tuple(variable.shape)) * tf.as_dtype(variable.dtype).size, id(variable) in trainable)
            for variable in all_variables(model)
        ),
        slots_per_weight=OPTIMIZER_SLOTS[optimization.optimizer],
        shards=shards,
    )


def _one_step(
    config: RunConfig,
    task: RunTask,
    cluster: SimulatedCluster,
    simulated: int,
    per_replica_batch: int,
    total_steps: int,
) -> None:
    """One batch through one compiled step on `simulated` replicas, each with its per-replica batch."""
    strategy = (
        build_strategy("mirrored", cpu_devices=simulated) if simulated > 1 else tf.distribute.get_strategy()
    )
    seed_everything(config.seed, deterministic=config.deterministic)  # As a run's first step starts.
    batch = per_replica_batch * simulated
    with strategy.scope():
        model = task.build_model()
        learning_rate = learning_rate_schedule(
            config.lr_schedule, config.learning_rate, total_steps, config.warmup_steps
        )
        optimizer = build_optimizer(config.optimizer, learning_rate, model)
    schedule, command = config.schedule, config.command
    one_batch = dataclasses.replace(
        config,
        schedule=dataclasses.replace(schedule, global_batch_size=batch),
        command=dataclasses.replace(command, mode="train"),
        cluster=dataclasses.replace(config.cluster, data_service=None),  # The pipeline checked here: no RPC.
    )
    train_data, _ = train_and_eval_data(one_batch, task.source)
    options = trainer_options(config, steps_per_epoch=None)
    options["cadence"] = dataclasses.replace(options["cadence"], steps_per_loop=1, eval_every=None)
    options["checkpoint"] = CheckpointOptions()  # No model_dir: nothing saved.
    trainer = Trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        global_batch_size=batch,
        **task.trainer_arguments(model),
        **options,
    )
    trainer.reports_goodput = False  # Nothing to book: one step.
    try:
        logs = trainer.train(1)
    finally:
        trainer.close()
    loss = logs.get("loss")
    shown = (
        f"{simulated} of the {cluster.replicas_in_sync} replicas"
        if simulated < cluster.replicas_in_sync
        else (f"{simulated} replica(s)")
    )
    logging.info(
        "%sone step of %s ran on %s, %d examples each: loss %s",
        PREFIX,
        task.model_name,
        shown,
        per_replica_batch,
        "?" if loss is None else f"{loss:.7g}",
    )
    if loss is not None and not math.isfinite(loss):
        raise UserError(f"the first step's loss is {loss}; check the data, the loss and --learning_rate")


class _Problems:
    """The problems found so far, each one line."""

    def __init__(self):
        self.lines: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def check(self, function, *args: Any, runs_user_code: str | None = None) -> Any:
        """`function(*args)`; a UserError it raises becomes a problem (None returned). Where it
        `runs_user_code` (what it does, as "the step"), so does an error the user's model or
        loss raises there (TensorFlow's, ValueError, TypeError), named at the user's line; in
        the engine's own checks those stay tracebacks: bugs, not the user's problems."""
        from engine.cli.config.flag_names import in_flag_terms

        caught = (tf.errors.OpError, ValueError, TypeError) if runs_user_code else ()
        try:
            return function(*args)
        except UserError as error:
            self.add(in_flag_terms(error))
        except caught as error:
            self.add(f"{runs_user_code} failed{step_failure(error)}")
        return None

    def report(self, model_dir: str | None) -> int:
        untouched = f"; {model_dir} was not written" if model_dir else ""
        if not self.lines:
            logging.info("%sok: no problem found%s", PREFIX, untouched)
            return 0
        logging.flush()
        for line in self.lines:
            print(f"engine.main: error: {PREFIX}{line}", file=sys.stderr)
        logging.info("%s%d problem(s)%s", PREFIX, len(self.lines), untouched)
        return USER_ERROR_EXIT


def step_failure(error: Exception) -> str:
    """`error` (raised while tracing or running the step) as ` at FILE:LINE (FUNCTION): MESSAGE`, the
    user's own frame that raised it and the message without autograph's trace of the engine's frames.
    The frame is found in the message where AutoGraph wrote its "in user code:" trace there (the
    error passed through converted code), else in the exception's own traceback."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras colours the message on a terminal.
    frames = [
        (path, int(line), function, match.end())
        for match in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)[^\n]*\n[^\n]*', text)
        for path, line, function in [match.groups()]
    ]
    message = text[frames[-1][3] :] if frames else text
    if not frames:
        frames = [(f.filename, f.lineno or 0, f.name, 0) for f in traceback.extract_tb(error.__traceback__)]
    engine_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    theirs = [f for f in frames if not f[0].startswith(engine_root) and "-packages" not in f[0]]
    where = ""
    if theirs:
        path, line, function, _ = theirs[-1]
        where = f" at {os.path.basename(path)}:{line} ({function})"
    return f"{where}: {one_line(message.split('Arguments received by', 1)[0].strip())}"


def _size(count: float) -> str:
    """Bytes in B/KiB/MiB/GiB, three significant digits."""
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.3g} {unit}"
