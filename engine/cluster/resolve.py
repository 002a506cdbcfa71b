"""Which cluster this process belongs to, and which task it is in it.

A cluster comes from exactly one place: the cluster flags
(`--worker_hosts`, `--ps_hosts`, `--chief_host`, `--task_type`,
`--task_index`), an existing `TF_CONFIG` environment variable (used as is),
or Slurm's `SLURM_*` variables (`--cluster_resolver=slurm`). Everything is
checked here, before TensorFlow starts, so that a typo is one line naming
the bad value instead of a hang on a port nobody listens on.

Pure Python on purpose: no TensorFlow import, so that `RunConfig.validate`
and `engine.launch` can use it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

from engine.errors import UserError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
RESOLVERS = ("tf_config", "slurm")
DEFAULT_SLURM_PORT_BASE = 8888


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster spec (job name -> "host:port" addresses) and this task in it."""

    spec: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief: the task
        that owns model_dir (checkpoints, summaries, metrics.json)."""
        if "chief" in self.spec:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def num_workers(self) -> int:
        return len(self.spec.get("worker", ()))

    @property
    def address(self) -> str:
        return self.spec[self.task_type][self.task_index]

    @property
    def is_evaluator(self) -> bool:
        """A sidecar that only reads checkpoints: it joins no collective and serves nothing."""
        return self.task_type == "evaluator"

    def training_spec(self) -> dict[str, tuple[str, ...]]:
        """The spec without the evaluator, which TensorFlow's training tasks must not wait for."""
        return {job: hosts for job, hosts in self.spec.items() if job != "evaluator"}

    def peers(self) -> list[tuple[str, str]]:
        """("type:index", address) of every other training task."""
        return [
            (f"{job}:{index}", address)
            for job, hosts in self.training_spec().items()
            for index, address in enumerate(hosts)
            if (job, index) != (self.task_type, self.task_index)
        ]

    def tf_config(self) -> str:
        """The TF_CONFIG JSON of this task."""
        return json.dumps(
            {
                "cluster": {job: list(hosts) for job, hosts in self.spec.items()},
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )

    def resolver(self):
        """A `SimpleClusterResolver` for tf.distribute (imports TensorFlow)."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({job: list(hosts) for job, hosts in self.training_spec().items()}),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )


def resolve_cluster(
    *,
    worker_hosts: Sequence[str] | None = None,
    ps_hosts: Sequence[str] | None = None,
    chief_host: str | None = None,
    task_type: str | None = None,
    task_index: int | None = None,
    cluster_resolver: str = "tf_config",
    slurm_port_base: int = DEFAULT_SLURM_PORT_BASE,
    environ: Mapping[str, str] = os.environ,
) -> Cluster | None:
    """The cluster the flags or the environment describe; None for one host."""
    if cluster_resolver not in RESOLVERS:
        raise UserError(
            f"unknown `cluster_resolver={cluster_resolver!r}`; choose one of: {', '.join(RESOLVERS)}"
        )
    from_flags = bool(worker_hosts or ps_hosts or chief_host)
    if from_flags and environ.get("TF_CONFIG"):
        raise UserError(
            "both the cluster's hosts (`worker_hosts`/`ps_hosts`/`chief_host`) and a TF_CONFIG "
            "environment variable are set; pass one of them (unset TF_CONFIG to use the hosts)"
        )
    if cluster_resolver == "slurm":
        if from_flags:
            raise UserError(
                "`cluster_resolver='slurm'` reads SLURM_* variables; "
                "drop `worker_hosts`, `ps_hosts` and `chief_host`"
            )
        return cluster_from_slurm(environ, port_base=slurm_port_base)
    if task_type == "evaluator" and not environ.get("TF_CONFIG"):
        # A sidecar evaluator reads the model_dir only; the hosts, if given, are not contacted.
        spec = {"worker": worker_hosts or (), "ps": ps_hosts or (), "chief": [chief_host] if chief_host else ()}
        return _checked(
            {job: hosts for job, hosts in spec.items() if hosts},
            task_type,
            0 if task_index is None else task_index,
            source="the cluster flags",
        )
    if from_flags:
        spec = {"worker": worker_hosts or (), "ps": ps_hosts or (), "chief": [chief_host] if chief_host else ()}
        if task_type is None:
            raise UserError("the cluster's hosts need `task_type` (worker, ps or chief) and `task_index`")
        return _checked(
            {job: hosts for job, hosts in spec.items() if hosts},
            task_type,
            0 if task_index is None else task_index,
            source="the cluster flags",
        )
    if environ.get("TF_CONFIG"):
        if task_type is not None or task_index is not None:
            raise UserError(
                "`task_type`/`task_index` are set but the cluster comes from TF_CONFIG, "
                'whose "task" entry says which task this is; drop them or unset TF_CONFIG'
            )
        return cluster_from_tf_config(environ["TF_CONFIG"])
    if task_type is not None or task_index is not None:
        raise UserError(
            f"`task_type={task_type!r}` / `task_index={task_index!r}` given without a cluster; "
            "pass `worker_hosts` (and `ps_hosts`, `chief_host`) or set TF_CONFIG"
        )
    return None


def cluster_from_tf_config(text: str) -> Cluster:
    """Parses and checks a TF_CONFIG value."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"TF_CONFIG is not valid JSON ({error}): {text[:200]!r}") from None
    except RecursionError:
        raise UserError(
            f"TF_CONFIG is nested too deeply to parse ({len(text)} characters): {text[:60]!r}...; "
            'it must be {"cluster": {...}, "task": {...}}'
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise UserError(f'TF_CONFIG needs a "cluster" object of job -> ["host:port", ...]; got {text[:200]!r}')
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise UserError(
            f'TF_CONFIG needs a "task" object such as {{"type": "worker", "index": 0}}; got {task!r}'
        )
    index = task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool):
        raise UserError(f"TF_CONFIG task index {index!r} must be an integer")
    return _checked(config["cluster"], task["type"], index, source="TF_CONFIG")


def cluster_from_slurm(environ: Mapping[str, str], *, port_base: int) -> Cluster:
    """Every Slurm task of this job step becomes a worker, with TF's Slurm rules:
    nodes in sorted order, each node's tasks on ports port_base, port_base+1, ...

    TF's `SlurmClusterResolver` itself cannot be used on machines without GPUs
    (it divides the node's GPUs among tasks with a step of 0).
    """
    from engine.compat import slurm_hostlist_parsers

    expand_hostlist, expand_tasks_per_node = slurm_hostlist_parsers()

    def variable(name: str, fallback: str | None = None) -> str:
        value = environ.get(f"SLURM_STEP_{name}") or (environ.get(f"SLURM_{fallback}") if fallback else None)
        if not value:
            raise UserError(f"`cluster_resolver='slurm'` but SLURM_STEP_{name} is not set; run inside `srun`")
        return value

    def parsed(parse, name: str, fallback: str, example: str):
        """`parse` of the variable SLURM_STEP_<name> (or SLURM_<fallback>), its error named."""
        value = variable(name, fallback)
        try:
            return parse(value)
        except (ValueError, TypeError, IndexError):
            source = f"SLURM_STEP_{name}" if environ.get(f"SLURM_STEP_{name}") else f"SLURM_{fallback}"
            raise UserError(
                f"{source}={value!r} does not parse as Slurm writes it (e.g. {example}); "
                "run inside `srun`, or fix the variable"
            ) from None

    if "SLURM_PROCID" not in environ:
        raise UserError("`cluster_resolver='slurm'` but SLURM_PROCID is not set; run inside `srun`")
    procid = environ["SLURM_PROCID"].strip()
    if not procid.isdigit():
        raise UserError(
            f"SLURM_PROCID={environ['SLURM_PROCID']!r} must be a task number (0, 1, ...); run inside `srun`"
        )
    hosts = parsed(expand_hostlist, "NODELIST", "JOB_NODELIST", "'node[1-4],gpu7'")
    tasks_per_node = parsed(expand_tasks_per_node, "TASKS_PER_NODE", "TASKS_PER_NODE", "'2(x3),1'")
    if len(hosts) != len(tasks_per_node):  # zip would pair them silently wrong.
        raise UserError(
            f"Slurm's node list names {len(hosts)} node(s) but its tasks per node give "
            f"{len(tasks_per_node)} count(s) ({tasks_per_node}); run inside `srun`, or fix the variables"
        )
    addresses = [
        f"{host}:{port_base + offset}"
        for host, count in sorted(zip(hosts, tasks_per_node, strict=True))
        for offset in range(count)
    ]
    return _checked({"worker": addresses}, "worker", int(procid), source="Slurm")


def check_strategy_cluster(strategy: str, cluster: Cluster | None) -> None:
    """Refuses a cluster that the strategy cannot run on, naming what is missing."""
    if cluster is not None and cluster.is_evaluator:
        return  # It evaluates on this host alone, whatever the training tasks run.
    if strategy == "parameter_server":
        if cluster is None:
            raise UserError(
                "`strategy='parameter_server'` needs a cluster with chief, worker and ps tasks: "
                "pass `chief_host`, `worker_hosts` and `ps_hosts`, set TF_CONFIG, or try it "
                "locally with `python -m engine.launch --num_workers=2 --num_ps=1 -- ...`"
            )
        missing = [job for job in ("chief", "worker", "ps") if not cluster.spec.get(job)]
        if missing:
            raise UserError(
                f"`strategy='parameter_server'` needs {' and '.join(missing)} task(s) in the cluster "
                f"(has {', '.join(sorted(cluster.spec))}); the chief is the coordinator"
            )
        if cluster.task_type != "chief":
            raise UserError(
                f"this process is {cluster.task_type}:{cluster.task_index} of a parameter-server "
                f"cluster; run `python -m engine.server` there (engine.main runs on the chief only)"
            )
    elif strategy == "multi_worker_mirrored":
        if cluster is not None and cluster.spec.get("ps"):
            raise UserError(
                "`strategy='multi_worker_mirrored'` does not use ps tasks but the cluster has "
                f"{len(cluster.spec['ps'])}; drop `ps_hosts` or use `strategy='parameter_server'`"
            )
    elif cluster is not None and strategy != "tpu":
        raise UserError(
            f"`strategy={strategy!r}` runs on one host but a cluster was given "
            f"({cluster.task_type}:{cluster.task_index}); use multi_worker_mirrored or parameter_server"
        )


def task_model_dir(model_dir: str, cluster: Cluster | None) -> str:
    """Where this task writes: model_dir on the chief, a private directory
    inside it elsewhere (TF's `write_filepath` pattern), removed at the end.

    Every worker of a synchronous strategy saves its rolling checkpoints and
    writes summaries at the same points (TensorFlow's multi-worker pattern: a
    save may run collectives), but only the chief's files are kept. Hooks
    that keep files of their own (`BestCheckpoint`, hook state) write on the
    chief only: their checkpoint holds mirrored variables, whose save runs no
    collective (a 2-worker run with --best_checkpoint_metric ends normally).
    """
    if cluster is None or cluster.is_chief:
        return model_dir
    return os.path.join(model_dir, ".workertemp", f"{cluster.task_type}_{cluster.task_index}")


def security_warning(program: str, ports: list[int]) -> str:
    """The one line every process that opens TensorFlow gRPC ports prints."""
    return (
        f"{program}: warning: TensorFlow gRPC port(s) {', '.join(map(str, ports))} accept "
        "unauthenticated connections on every network interface (not only the host named in the "
        "cluster); anyone who reaches them can run code as this user: use a private network or a "
        "firewall that admits only the cluster's hosts"
    )


def _checked(spec: Mapping[str, object], task_type: object, task_index: int, *, source: str) -> Cluster:
    clean: dict[str, tuple[str, ...]] = {}
    for job, hosts in spec.items():
        if job not in TASK_TYPES:
            raise UserError(f"unknown task type {job!r} in {source}; use {', '.join(TASK_TYPES)}")
        if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)) or not hosts:
            raise UserError(f'{source}: job {job!r} needs a non-empty list of "host:port", got {hosts!r}')
        clean[job] = tuple(_check_address(str(host), job, source) for host in hosts)
    if "chief" in clean and len(clean["chief"]) != 1:
        raise UserError(f"{source}: a cluster has one chief, got {len(clean['chief'])}")
    if task_type not in TASK_TYPES:
        raise UserError(f"unknown task type {task_type!r} in {source}; use {', '.join(TASK_TYPES)}")
    if task_type == "evaluator" and "evaluator" not in clean:
        if task_index != 0:
            raise UserError(f"{source}: there is one evaluator task, index 0, not {task_index}")
        return Cluster(clean, "evaluator", 0)  # Its address is never used: it serves nothing.
    if task_type not in clean:
        raise UserError(
            f"task type {task_type!r} from {source} is not in the cluster ({', '.join(clean)}); "
            f"add its hosts or pick one of those"
        )
    if not 0 <= task_index < len(clean[task_type]):
        raise UserError(
            f"task index {task_index} from {source} is out of range: job {task_type!r} has "
            f"{len(clean[task_type])} task(s), so use 0..{len(clean[task_type]) - 1}"
        )
    duplicates = {
        a for hosts in clean.values() for a in hosts if sum(h == a for hs in clean.values() for h in hs) > 1
    }
    if duplicates:
        raise UserError(f"{source}: address(es) {', '.join(sorted(duplicates))} used by more than one task")
    return Cluster(clean, str(task_type), task_index)


def _check_address(address: str, job: str, source: str) -> str:
    host, separator, port = address.rpartition(":")
    if not separator or not host:
        raise UserError(f"{source}: {job} address {address!r} has no port; write host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{source}: {job} address {address!r} has a bad port {port!r}; use 1-65535")
    return address
