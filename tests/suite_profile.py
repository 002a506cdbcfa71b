"""Where the suite's time goes: each test's wall time, its process's CPU and its children's, and
the Python stacks of a test that waits without working.

The suite is CPU-bound on 2 cores (its budget: README), so a test's cost is its CPU, not its wall
time, and a test whose wall time far exceeds its CPU was waiting: on its processes (children's
CPU), on a timeout it tests, or stalled. Turn it on with the conftest option

    python -m pytest --profile-suite=DIR        (each worker writes DIR/<worker>.tsv)
    python tests/suite_profile.py DIR           (the table by module, then the stalls)

A test still running after `--profile-stall-s` (8) gets every Python thread's stack dumped to
DIR/<worker>.stacks, once per that many seconds, by a Python thread that holds the GIL while it
reads them (faulthandler's watchdog reads them without it and crashed a worker mid-dump while
MirroredStrategy's replica threads were tracing: "node down: Not properly terminated"). A stack that
ends in the test runner's own frame, with no frame of the test's, is a native wait inside a
destructor. Seen: a distributed iterator (MultiDeviceIterator) freed with a finished test's
locals, or later by the collector, whose host-side tf.data iterator joins one of its threads for
seconds (up to a minute) with every thread asleep. `eu-stack -p <worker pid>` (elfutils) prints
every native thread's stack; `py-spy dump --native` only the Python threads'.
"""

from __future__ import annotations

import csv
import os
import resource
import sys
import threading
import time
import traceback
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
        self._watch = _StallWatch(self._stacks, stall_s)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._stacks.write(f"\n===== {item.nodeid} started at {time.time():.1f}\n")
        self._stacks.flush()
        self._watch.begin()
        started = time.time()
        own, children = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
        try:
            yield
        finally:
            self._watch.end()
            row = (
                item.nodeid,
                f"{time.time() - started:.2f}",
                f"{_cpu_seconds(resource.RUSAGE_SELF) - own:.2f}",
                f"{_cpu_seconds(resource.RUSAGE_CHILDREN) - children:.2f}",
                f"{started:.1f}",
            )
            with open(self._rows, "a", newline="") as rows:
                csv.writer(rows, delimiter="\t").writerow(row)


class _StallWatch:
    """Dumps every Python thread's stack to `file` each `stall_s` seconds of one test's run."""

    def __init__(self, file, stall_s: float):
        self._file = file
        self._stall_s = stall_s
        self._changed = threading.Condition()
        self._test_started: float | None = None  # None between tests.
        threading.Thread(target=self._watch, name="suite-profile-stall-watch", daemon=True).start()

    def begin(self) -> None:
        with self._changed:
            self._test_started = time.monotonic()
            self._changed.notify()

    def end(self) -> None:
        with self._changed:
            self._test_started = None
            self._changed.notify()

    def _watch(self) -> None:
        with self._changed:
            while True:
                started = self._test_started
                if started is None:
                    self._changed.wait()
                    continue
                self._changed.wait(self._stall_s)
                if self._test_started == started:  # The same test, still running: a dump each stall_s.
                    self._dump(time.monotonic() - started)

    def _dump(self, running_s: float) -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        self._file.write(f"running for {running_s:.0f} s\n")
        for ident, frame in sys._current_frames().items():
            self._file.write(f"Thread {names.get(ident, ident)} (most recent call last):\n")
            self._file.write("".join(traceback.format_stack(frame)) + "\n")
        self._file.flush()


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
