"""Hosts of their own for multi-host tests: Linux network namespaces on a virtual bridge.

Each host is a namespace with loopback and one interface `eth0` at
10.213.0.(i+1)/24, cabled by a veth pair to a bridge that sits in a
namespace of its own: the tests' traffic never touches the machine's own
interfaces, and only these addresses are used. `partition(i)` sets host
i's link down (it still runs, but nobody reaches it); `heal(i)` sets it up.
Everything is removed at the end, processes inside first. Needs root and
iproute2; `VirtualHosts.unavailable()` says why where they cannot be made.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

SUBNET = "10.213.0"
COMMAND_TIMEOUT = 20


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=check)


class VirtualHosts:
    """`count` namespaces h0.. on one bridge; use as a context manager."""

    def __init__(self, count: int):
        tag = f"e{os.getpid() % 100000}"  # Unique beside the other xdist worker's hosts.
        self.bridge = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2) to make network namespaces"
        if os.geteuid() != 0:
            return "network namespaces need root (CI runs as root)"
        probe = f"e{os.getpid() % 100000}probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> VirtualHosts:
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for index, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                port = f"p{index}"
                _ip(
                    "-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name
                )
                _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def command(self, index: int, *argv: str) -> list[str]:
        """`argv` run inside host `index`."""
        return ["ip", "netns", "exec", self.names[index], *argv]

    def python(self, index: int, *args: str) -> list[str]:
        return self.command(index, sys.executable, *args)

    def partition(self, index: int) -> None:
        _ip("-n", self.names[index], "link", "set", "eth0", "down")

    def heal(self, index: int) -> None:
        _ip("-n", self.names[index], "link", "set", "eth0", "up")

    def remove(self) -> None:
        """Kills what still runs inside the hosts, then deletes them (and their links)."""
        for name in [*self.names, self.bridge]:
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGCONT)
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
