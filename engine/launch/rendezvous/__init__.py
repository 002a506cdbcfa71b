"""The multi-host launcher's rendezvous: how the `engine.launch` of every node
learns every training task's address, and how they agree to restart or end.

It exchanges addresses and decisions only; training runs on tf.distribute's
own gRPC runtime. Node 0's launcher serves it at `--rendezvous=HOST:PORT`
(`RendezvousServer`, `server_side`); every node's launcher, node 0's too, is a client
(`RendezvousClient`, `client_side`). Both speak `protocol`: length-prefixed JSON
frames, a handshake in which each side proves the run's `secret` without sending
it, then an HMAC and a sequence number on every message, so that nothing can be
injected, changed, replayed or reordered. Pure Python: no TensorFlow.
"""

from engine.launch.rendezvous.client_side import RendezvousClient
from engine.launch.rendezvous.protocol import (
    LAUNCH_SETTING,
    PROTOCOL,
    ProtocolError,
    check_from_node,
    check_from_server,
    parse_address,
    settings_difference,
    settings_digest,
    valid_host,
)
from engine.launch.rendezvous.secret import SECRET_ENV, SECRET_FLAG, is_loopback, read_secret, secret_problem
from engine.launch.rendezvous.server_side import RendezvousServer, source_of

__all__ = [
    "LAUNCH_SETTING",
    "PROTOCOL",
    "SECRET_ENV",
    "SECRET_FLAG",
    "ProtocolError",
    "RendezvousClient",
    "RendezvousServer",
    "check_from_node",
    "check_from_server",
    "is_loopback",
    "parse_address",
    "read_secret",
    "secret_problem",
    "settings_difference",
    "settings_digest",
    "source_of",
    "valid_host",
]
