"""Cluster resolution from flags, TF_CONFIG and Slurm: pure Python, no processes.

Covers: engine/cluster/resolve.py.
"""

import json

import pytest

from engine.cluster import Cluster, check_strategy_cluster, resolve_cluster, task_model_dir
from engine.errors import UserError

WORKERS = ["a:2222", "b:2222"]


def test_flags_build_the_same_tf_config_tensorflow_reads():
    cluster = resolve_cluster(
        worker_hosts=WORKERS,
        ps_hosts=["p:2222"],
        chief_host="c:2222",
        task_type="worker",
        task_index=1,
        environ={},
    )
    assert cluster.address == "b:2222" and not cluster.is_chief and cluster.num_workers == 2
    config = json.loads(cluster.tf_config())
    assert config == {
        "cluster": {"worker": WORKERS, "ps": ["p:2222"], "chief": ["c:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    resolver = cluster.resolver()
    assert resolver.cluster_spec().as_dict()["worker"] == WORKERS
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_tf_config_is_used_as_is_and_worker_0_is_chief_without_a_chief():
    text = json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 0}})
    cluster = resolve_cluster(environ={"TF_CONFIG": text})
    assert cluster == Cluster({"worker": tuple(WORKERS)}, "worker", 0) and cluster.is_chief
    assert task_model_dir("/m", cluster) == "/m"
    assert task_model_dir("/m", Cluster({"worker": tuple(WORKERS)}, "worker", 1)) == "/m/.workertemp/worker_1"


def test_no_cluster_means_one_host():
    assert resolve_cluster(environ={}) is None


SLURM = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
BAD = [
    (dict(environ={"TF_CONFIG": "{not json"}), "TF_CONFIG is not valid JSON"),
    (
        dict(environ={"TF_CONFIG": '{"cluster": {"boss": ["a:1"]}, "task": {"type": "boss"}}'}),
        "unknown task type 'boss' in TF_CONFIG",
    ),
    (
        dict(environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}'}),
        "task index 3 from TF_CONFIG is out of range: job 'worker' has 1 task(s), so use 0..0",
    ),
    (dict(environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}}'}), 'TF_CONFIG needs a "task"'),
    (dict(worker_hosts=["a"], task_type="worker", environ={}), "worker address 'a' has no port"),
    (dict(worker_hosts=["a:http"], task_type="worker", environ={}), "bad port 'http'"),
    (dict(worker_hosts=["a:1", "a:1"], task_type="worker", environ={}), "a:1 used by more than one task"),
    (dict(worker_hosts=["a:1"], environ={}), "need `task_type` (worker, ps or chief) and `task_index`"),
    (dict(worker_hosts=["a:1"], task_type="ps", environ={}), "task type 'ps' from the cluster flags is not in"),
    (
        dict(worker_hosts=["a:1"], task_type="worker", environ={"TF_CONFIG": "{}"}),
        "both the cluster's hosts (`worker_hosts`/",
    ),
    (dict(task_type="worker", environ={}), "`task_type='worker'` / `task_index=None` given without a cluster"),
    (dict(cluster_resolver="k8s", environ={}), "unknown `cluster_resolver='k8s'`"),
    (dict(cluster_resolver="slurm", environ={}), "`cluster_resolver='slurm'` but SLURM_PROCID is not set"),
    (dict(environ={"TF_CONFIG": "[" * 100_000 + "]" * 100_000}), "TF_CONFIG is nested too deeply to parse"),
    (
        dict(cluster_resolver="slurm", environ=dict(SLURM, SLURM_PROCID="abc")),
        "SLURM_PROCID='abc' must be a task",
    ),
    (
        dict(cluster_resolver="slurm", environ=dict(SLURM, SLURM_STEP_NODELIST="node[1-")),
        "SLURM_STEP_NODELIST='node[1-' does not parse as Slurm writes it",
    ),
    (
        dict(cluster_resolver="slurm", environ=dict(SLURM, SLURM_STEP_TASKS_PER_NODE="two")),
        "SLURM_STEP_TASKS_PER_NODE='two' does not parse as Slurm writes it",
    ),
    (
        dict(cluster_resolver="slurm", environ=dict(SLURM, SLURM_STEP_TASKS_PER_NODE="2")),
        "node list names 2 node(s) but its tasks per node give 1 count(s)",
    ),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_clusters_are_one_line_user_errors(kwargs, message):
    with pytest.raises(UserError) as error:
        resolve_cluster(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "--" not in str(error.value)  # The library's arguments, not the command line's flags.


def test_slurm_variables_follow_tensorflows_rules():
    environ = {"SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    cluster = resolve_cluster(cluster_resolver="slurm", slurm_port_base=9000, environ=environ)
    assert cluster.spec == {"worker": ("node1:9000", "node1:9001", "node2:9000", "node2:9001")}
    assert (cluster.task_type, cluster.task_index, cluster.address) == ("worker", 3, "node2:9001")


def test_strategies_refuse_clusters_they_cannot_use():
    mwm = Cluster({"worker": ("a:1",), "ps": ("p:1",)}, "worker", 0)
    with pytest.raises(UserError, match="does not use ps tasks.*drop `ps_hosts`"):
        check_strategy_cluster("multi_worker_mirrored", mwm)
    ps = Cluster({"chief": ("c:1",), "worker": ("a:1",), "ps": ("p:1",)}, "worker", 0)
    with pytest.raises(UserError, match="run `python -m engine.server` there"):
        check_strategy_cluster("parameter_server", ps)
    with pytest.raises(UserError, match="runs on one host"):
        check_strategy_cluster("mirrored", ps)
    check_strategy_cluster("parameter_server", Cluster(ps.spec, "chief", 0))


def test_an_evaluator_is_outside_the_training_cluster():
    spec = {"chief": ["c:1"], "worker": WORKERS, "ps": ["p:1"], "evaluator": ["e:1"]}
    worker = resolve_cluster(environ={"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker"}})})
    # TensorFlow's training tasks never wait for (or all-reduce with) the evaluator.
    assert "evaluator" not in worker.resolver().cluster_spec().as_dict()
    assert ("evaluator:0", "e:1") not in worker.peers() and ("chief:0", "c:1") in worker.peers()
    evaluator = resolve_cluster(
        environ={"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "evaluator"}})}
    )
    assert evaluator.is_evaluator and not evaluator.is_chief
    for strategy in ("parameter_server", "multi_worker_mirrored", "default"):
        check_strategy_cluster(strategy, evaluator)  # it evaluates alone, whatever the cluster trains with
    # --task_type=evaluator needs no hosts: it contacts nobody.
    alone = resolve_cluster(task_type="evaluator", environ={})
    assert alone.is_evaluator and alone.spec == {}
    with pytest.raises(UserError, match="one evaluator task, index 0, not 1"):
        resolve_cluster(task_type="evaluator", task_index=1, environ={})
