"""Where the suite's time goes: each test's wall time, its process's CPU and its children's, and
the Python stacks of a test that waits without working.

The suite is CPU-bound on 2 cores (its budget: README), so a test's cost is its CPU, not its wall
time, and a test whose wall time far exceeds its CPU was waiting: on its processes (children's
CPU), on a timeout it tests, or stalled. Turn it on with the conftest option

    python -m pytest --profile-suite=DIR        (each worker writes DIR/<worker>.tsv)
    python tests/suite_profile.py DIR           (the table by module, then the stalls)

A test still running after `--profile-stall-s` (8) gets every Python thread's stack dumped to
DIR/<worker>.stacks, once per that many seconds (faulthandler: no extra library). A stack that
ends in the test runner's own frame, with no frame of the test's, is a native wait inside a
destructor. Seen: a distributed iterator (MultiDeviceIterator) freed with a finished test's
locals, or later by the collector, whose host-side tf.data iterator joins one of its threads for
seconds (up to a minute) with every thread asleep. `eu-stack -p <worker pid>` (elfutils) prints
every native thread's stack; `py-spy dump --native` only the Python threads'.
"""

from __future__ import annotations

import csv
import faulthandler
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class SuiteProfile:
    """A pytest plugin object: one row per test in `<directory>/<worker>.tsv`."""

    def __init__(self, directory: str, stall_s: float):
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._rows = self._directory / f"{worker}.tsv"
        self._stacks = open(self._directory / f"{worker}.stacks", "a")  # noqa: SIM115 (open for the session)
        self._stall_s = stall_s

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._stacks.write(f"\n===== {item.nodeid} started at {time.time():.1f}\n")
        self._stacks.flush()
        faulthandler.dump_traceback_later(self._stall_s, repeat=True, file=self._stacks)
        started = time.time()
        own, children = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            row = (
                item.nodeid,
                f"{time.time() - started:.2f}",
                f"{_cpu_seconds(resource.RUSAGE_SELF) - own:.2f}",
                f"{_cpu_seconds(resource.RUSAGE_CHILDREN) - children:.2f}",
                f"{started:.1f}",
            )
            with open(self._rows, "a", newline="") as rows:
                csv.writer(rows, delimiter="\t").writerow(row)


def register(config, directory: str, stall_s: float) -> None:
    """Registers the plugin (from tests/conftest.py, in each process that runs tests)."""
    config.pluginmanager.register(SuiteProfile(directory, stall_s), "suite_profile")


def summary(directory: str, top: int = 25) -> str:
    """The modules by CPU (wall, own, children's), their sum, and the tests that waited longest
    without working (wall minus all CPU)."""
    tests = []
    for path in sorted(Path(directory).glob("*.tsv")):
        with open(path, newline="") as rows:
            for name, wall, own, children, _ in csv.reader(rows, delimiter="\t"):
                tests.append((name, float(wall), float(own), float(children)))
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for name, wall, own, children in tests:
        totals = modules[name.split("::")[0]]
        totals[0] += wall
        totals[1] += own
        totals[2] += children
        totals[3] += 1
    lines = [f"{'wall':>8} {'own':>7} {'child':>7} {'tests':>5}  module"]
    ranked = sorted(modules.items(), key=lambda item: -(item[1][1] + item[1][2]))
    for module, (wall, own, children, count) in ranked[:top]:
        lines.append(f"{wall:8.1f} {own:7.1f} {children:7.1f} {count:5d}  {module}")
    lines.append(
        f"{sum(t[1] for t in tests):8.1f} {sum(t[2] for t in tests):7.1f} "
        f"{sum(t[3] for t in tests):7.1f} {len(tests):5d}  all (CPU-s: own + children's)"
    )
    lines.append("\nwaited without working (wall - CPU, s):")
    waits = sorted(tests, key=lambda t: -(t[1] - t[2] - t[3]))
    lines.extend(f"{wall - own - children:8.1f}  {name}" for name, wall, own, children in waits[:top])
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
