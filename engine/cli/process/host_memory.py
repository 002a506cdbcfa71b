"""How much memory this process may use, so that a batch that cannot fit is
refused up front instead of ending in an out-of-memory kill or SIGSEGV deep
inside tf.data (a 50-million-example batch ran 161 s before it crashed)."""

from __future__ import annotations

import os
import resource

# cgroup v2 and v1 limits of the container the process runs in.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes() -> int | None:
    """The smallest of physical memory, the address-space and data rlimits and the
    cgroup's limit; None when none of them is known."""
    limits: list[int] = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        pass
    for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft, _ = resource.getrlimit(kind)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    positive = [limit for limit in limits if limit > 0]
    return min(positive) if positive else None
