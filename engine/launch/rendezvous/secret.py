"""The run's secret: where a node reads it, and when the rendezvous may go without one.

The run's nodes share a secret (`SECRET_ENV` or a file; required off loopback,
`secret_problem`). The handshake proves it in both directions without sending it
(`protocol`): the node proves itself first, so the always-listening server gives a
stranger nothing to work on; then the server proves itself, so a fake node 0 cannot
steer a node either. Without the secret nothing a connection sends reaches the run.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import Mapping

SECRET_ENV = "ENGINE_RENDEZVOUS_SECRET"
SECRET_FLAG = "--rendezvous_secret_file"
MIN_SECRET_BYTES = 16  # A shorter secret could be guessed offline from one recorded handshake.
MAX_SECRET_FILE_BYTES = 4096


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback (127.0.0.0/8, ::1): only
    then may the rendezvous go without a secret, reachable from this machine alone."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(
            ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
        )
    except ValueError:
        return False


def read_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The run's secret: the file `path` names (`--rendezvous_secret_file`) or else `SECRET_ENV`;
    None when neither is given. ValueError, one line naming the source and the fix, for a file
    that is not a small regular file, one that users other than its owner may read or write,
    or a secret too short to resist guessing."""
    if path is not None:
        where = f"{SECRET_FLAG}={path}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # A FIFO must not block the launcher.
        except OSError as error:
            raise ValueError(f"{where}: cannot read it ({error.strerror or error})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SECRET_FILE_BYTES:
                raise ValueError(
                    f"{where} must be a regular file of at most {MAX_SECRET_FILE_BYTES} bytes holding the secret"
                )
            if info.st_mode & 0o077:  # As ssh refuses a private key others may read.
                raise ValueError(
                    f"{where} may be read or written by other users (mode {stat.S_IMODE(info.st_mode):04o}), "
                    f"and whoever reads the secret can join and steer the run: `chmod 600 {path}`"
                )
            raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
        finally:
            os.close(fd)
        secret = raw.strip()
    elif SECRET_ENV in environ:
        where = f"{SECRET_ENV}"
        secret = environ[SECRET_ENV].strip().encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where} holds a secret of {len(secret)} byte(s); use at least {MIN_SECRET_BYTES} random ones, "
            "the same on every node, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return secret


def secret_problem(host: str, secret: bytes | None) -> str | None:
    """Why the rendezvous at `host` may not run as given: off loopback it needs the secret."""
    if secret is not None or is_loopback(host):
        return None
    return (
        f"the rendezvous at {host} is reachable from other machines, so the run's nodes must share a "
        f"secret: export {SECRET_ENV} or pass {SECRET_FLAG}=FILE (a file only this user reads) with the "
        "same random value on every node, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
    )
