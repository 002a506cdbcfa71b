"""A peer that stops answering mid-run: TF's errors become one line naming it, and the
heartbeat bound reaches TF (the real frozen and partitioned peers: tests/cluster/test_multi_host.py)."""

import json

import pytest
import tensorflow as tf

from engine.cluster import resolve_cluster
from engine.cluster.peer_loss import peer_lost_message
from engine.errors import PEER_LOST_EXIT, PeerLostError

# TF 2.21's words for a worker frozen by SIGSTOP (seen on worker:0, its peer worker:1).
UNHEALTHY = (
    "Graph execution error:\n\nDetected at node while/sgd/CollectiveReduceV2 defined at "
    "(most recent call last):\n"
    '  File "engine/loop/compiled.py", line 95, in run_step\n'
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
    "The tasks have crashed. Check the task logs for an earlier error.\n"
    "\t [[{{node while/sgd/CollectiveReduceV2}}]] [Op:__inference_train_loop_882]"
)


def _worker0():
    return resolve_cluster(worker_hosts=["localhost:1111", "localhost:2222"], task_type="worker", task_index=0)


def test_unhealthy_tasks_become_one_line_naming_the_frozen_peer():
    error = tf.errors.UnavailableError(None, None, UNHEALTHY)
    kept = "the latest checkpoint (x) is kept"
    message = peer_lost_message(error, _worker0(), heartbeat_timeout=10, kept=kept)
    assert message is not None and "\n" not in message
    assert message.startswith("worker:0: worker:1 (localhost:2222) stopped answering (no heartbeat for 10 s)")
    assert "the latest checkpoint (x) is kept" in message and "--max_restarts" in message


def test_a_dropped_connection_names_every_peer_and_other_errors_are_left_alone():
    closed = tf.errors.UnavailableError(None, None, "Socket closed\nAdditional GRPC error information")
    message = peer_lost_message(closed, _worker0(), heartbeat_timeout=10, kept="kept")
    assert message is not None and "worker:1 (localhost:2222) stopped answering (Socket closed)" in message
    unrelated = tf.errors.InternalError(None, None, "Blas GEMM launch failed")
    assert peer_lost_message(unrelated, _worker0(), heartbeat_timeout=10, kept="kept") is None
    assert peer_lost_message(closed, None, heartbeat_timeout=10, kept="kept") is None  # No cluster, no peer.


def test_the_heartbeat_timeout_reaches_the_coordination_service(monkeypatch):
    """--heartbeat_timeout bounds the detection because it is what TF's coordination service
    is configured with (end to end, the frozen worker and partitioned host of
    tests/cluster/test_multi_host.py are detected within it)."""
    from tensorflow.python.eager import context

    from engine.cluster import multi_host

    configured = {}
    monkeypatch.setattr(type(context.context()), "coordination_service", property(lambda self: None))
    monkeypatch.setattr(
        context.context(), "configure_coordination_service", lambda **kwargs: configured.update(kwargs)
    )
    multi_host._configure_coordination(_worker0(), 300.0, 12.0)
    assert (
        configured["heartbeat_timeout_in_ms"] == 12000 and configured["cluster_register_timeout_in_ms"] == 300000
    )
    assert configured["service_leader"] == "/job:worker/replica:0/task:0"


class _Process:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_the_launchers_restart_line_names_the_peer_that_stopped_answering():
    from engine.launch.task_processes import Task, cause_of

    hosts = ["localhost:1111", "localhost:2222"]
    workers = [
        Task(resolve_cluster(worker_hosts=hosts, task_type="worker", task_index=i), [], _Process(code))
        for i, code in ((0, PEER_LOST_EXIT), (1, None))
    ]
    restart = cause_of(workers[0], PEER_LOST_EXIT, workers)
    assert restart == "worker:1 stopped answering (worker:0 exited with status 69)"
    assert cause_of(workers[0], 1, workers) == "worker:0 exited with status 1"


# TF 2.21's words on worker:1 when worker:0 exits (refused in one line: its model_dir in use)
# while worker:1 waits in the collective broadcast of its first variable's initial value.
REFUSED = (
    "{{function_node __wrapped__CollectiveBcastRecv_device_/job:worker/replica:0/task:1/device:CPU:0}} "
    "Collective ops is aborted by: failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:127.0.0.1:1111: Failed to connect to remote host: Connection refused\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.WorkerService/CompleteInstance:\n"
    "The error could be from a previous operation. Restart your program to reset. [Op:CollectiveBcastRecv]"
)


@pytest.mark.parametrize("cluster", [True, False])
def test_a_peer_lost_while_the_model_is_built_is_one_line_not_a_traceback(monkeypatch, cluster):
    """Before training (building, restoring) a lost peer is the same line as mid-training: the
    other workers of a chief refused for its model_dir in use ended in a 45-line traceback.
    Without a cluster there is no peer to name, and TF's error is left as it is."""
    from helpers import environment, run_config

    from engine.cli.config.settings.cluster import resolve_multi_host
    from engine.cli.run import job

    workers = {"worker": ["localhost:1111", "localhost:2222"]}
    tf_config = {"cluster": workers, "task": {"type": "worker", "index": 1}}
    env = {"TF_CONFIG": json.dumps(tf_config) if cluster else None}
    config = run_config("--strategy=multi_worker_mirrored", "--model=mlp", "--dataset=synthetic", env=env)
    with environment(env):  # As engine.main resolves it, once, and passes it down.
        multi_host = resolve_multi_host(config)

    def collective_refused(*args):
        raise tf.errors.UnavailableError(None, None, REFUSED)

    monkeypatch.setattr(job, "_run", collective_refused)
    if not cluster:
        with pytest.raises(tf.errors.UnavailableError):
            job.run(config, multi_host)
        return
    with pytest.raises(PeerLostError) as raised:
        job.run(config, multi_host)
    message = str(raised.value)
    assert "\n" not in message and raised.value.exit_status == PEER_LOST_EXIT
    assert message.startswith("worker:1: worker:0 (localhost:1111) stopped answering (Collective ops is aborted")
    assert "; it stopped before training; rerun, or use engine.launch --max_restarts" in message
