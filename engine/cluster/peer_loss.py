"""A peer that stopped answering mid-run, as one line instead of TensorFlow's traceback.

MultiWorkerMirroredStrategy's coordination service sends heartbeats between
the tasks; a frozen (SIGSTOP), partitioned or dead task stops sending them and
the collectives of every other task abort with it (TF 2.21, measured):

    UnavailableError: ... Collective ops is aborted by: Error reported from
    /job:worker/task:1: The following tasks are unhealthy (stopped sending
    heartbeats):
    /job:worker/replica:0/task:1

A dead task's dropped connection ("Socket closed", "Connection reset by
peer") or a collective past `collective_timeout` end the collectives too.
`peer_lost_message` turns these into one line naming the task(s); the caller
raises `engine.errors.PeerLostError`, whose exit status the launcher restarts on.
"""

from __future__ import annotations

import re

import tensorflow as tf

from engine.cluster.resolve import Cluster
from engine.errors import one_line

# The errors a collective ends with when a peer is lost.
PEER_LOST_ERRORS: tuple[type[tf.errors.OpError], ...] = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.InternalError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
)
# What TF 2.21 says in them: heartbeats first (the frozen or partitioned peer), then dead ones.
_HEARTBEAT_SIGNS = ("stopped sending heartbeats", "unhealthy", "heartbeat")
_CONNECTION_SIGNS = (
    "Socket closed",
    "Connection reset by peer",
    "failed to connect to all addresses",
    "Connection refused",
    "Collective ops is aborted",
    "timed out",
    "Deadline Exceeded",
)
# "/job:worker/replica:0/task:1" or "/job:worker/task:1".
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")


def peer_lost_message(
    error: tf.errors.OpError, cluster: Cluster | None, *, heartbeat_timeout: float, kept: str
) -> str | None:
    """One line naming the peer(s) `error` says stopped answering, and what is kept; None for
    an error that is no lost peer's (it keeps its traceback)."""
    if cluster is None or not isinstance(error, PEER_LOST_ERRORS):
        return None
    text = error.message or ""
    if any(sign in text for sign in _HEARTBEAT_SIGNS):
        why = f"no heartbeat for {heartbeat_timeout:g} s" if heartbeat_timeout else "no heartbeat"
    elif any(sign in text for sign in _CONNECTION_SIGNS):
        why = _first_line(text)
    else:
        return None
    return (
        f"{cluster.task_type}:{cluster.task_index}: {lost_peers(text, cluster)} stopped answering ({why}): "
        f"frozen, partitioned or dead; {kept}; rerun, or use engine.launch --max_restarts"
    )


def lost_peers(text: str, cluster: Cluster) -> str:
    """'worker:1 (host:port)' for each other task `text` names; every peer where it names none."""
    me = (cluster.task_type, cluster.task_index)
    named = {(job, int(index)) for job, index in _TASK.findall(text)} - {me}
    addresses = {name: address for name, address in cluster.peers()}
    peers = [f"{job}:{index}" for job, index in sorted(named) if f"{job}:{index}" in addresses]
    peers = peers or list(addresses)
    return ", ".join(f"{name} ({addresses[name]})" for name in peers) or "a peer"


def _first_line(text: str) -> str:
    """TF's own words: the first line that is neither the graph-error header nor the stack."""
    for line in text.splitlines():
        if line and not line.startswith(" ") and not line.startswith(("Graph execution error", "Detected at")):
            line = re.sub(r"\{\{[^}]*\}\}\s*", "", line)
            return one_line(re.sub(r"\s*\[Op:.*$", "", line), 160)
    return one_line(text, 160)
