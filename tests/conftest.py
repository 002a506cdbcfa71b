"""Test session set-up: two logical CPU devices, so that mirrored tests have
two replicas on a machine without GPUs. This must run before any test
touches a TensorFlow device, which is why it lives here.

Under pytest-xdist (setup.cfg: -n 2) the controller process runs no test and
imports no TensorFlow (5 CPU-s of every run); each worker sets TensorFlow up
in `pytest_configure`, before it collects a test module.
"""

import atexit
import gc
import os
import sys
from pathlib import Path

import pytest
import started_processes

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# As every engine command does (engine/command_start.py; importing it here would import TensorFlow
# into pytest-xdist's controller): numpy's BLAS on one thread, in these processes and the ones
# they start, and the collector's first generation every 20,000 allocations. A test worker holds
# every module's models and traced graphs: with Python's default (700) the collector walked
# them some 3,000 times in the fast tier's conformance and trainer modules, 5 of their 49 s.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
gc.set_threshold(20_000, *gc.get_threshold()[1:])

TEST_CPU_DEVICES = 2


def runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller, which hands tests to its workers and runs none."""
    distributing = bool(getattr(config.option, "numprocesses", 0)) and not config.option.collectonly
    return hasattr(config, "workerinput") or not distributing


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("suite profile", "where the suite's time goes (tests/suite_profile.py)")
    group.addoption("--profile-suite", metavar="DIR", help="write each test's wall and CPU seconds to DIR")
    group.addoption("--profile-stall-s", type=float, default=8.0, help="dump a test's stacks past this")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        atexit.register(end_worker_at_once)  # Registered before TensorFlow's and the engine's: runs after them.
    # The processes the tests start are ended with the run, and on its SIGTERM or SIGINT; in the
    # controller too, which passes SIGTERM on to its workers. Its exit handler runs before the above.
    started_processes.install()
    if not runs_tests(config):
        return
    if config.getoption("profile_suite"):
        from suite_profile import register

        register(config, config.getoption("profile_suite"), config.getoption("profile_stall_s"))
    from engine.native_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # TensorFlow's C++ start-up lines held back.
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * TEST_CPU_DEVICES)
    # TensorFlow's and Keras's modules live as long as the worker: frozen, they are no longer
    # traversed by each full collection of the worker's garbage (the tests' models and graphs).
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """A worker ends through `end_worker_at_once` (os._exit): no finalization for the input
    iterators' release threads to fear, so its exit waits for none (a tf.data destructor that
    never returns would hold it for iterator_release.EXIT_WAIT_S)."""
    if hasattr(config, "workerinput"):
        from engine.loop import iterator_release

        iterator_release.do_not_wait_at_exit()


def end_worker_at_once() -> None:
    """A pytest-xdist worker's last exit handler: its reports are sent and every other handler has
    run (the engine's included), so the interpreter's teardown of the worker's TensorFlow state,
    thousands of graphs and the iterators of cached trainers, has nothing left to give; it took
    1-10 s at the end of every run, which waits for its slowest worker to be gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


TESTS = Path(__file__).resolve().parent
FOLDER_TIERS = {"cli": "cli", "process": "process", "cluster": "cluster"}  # tests/unit: no tier marker.


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    """A test's tier (setup.cfg) is its folder's: tests/cli, tests/process and tests/cluster mark
    theirs; tests/unit has none. A module not split yet marks its few heavier tests itself.
    A test that starts processes (tier process or cluster) is in the full suite only: it is
    marked slow, so that -m "not slow" (the fast tier) starts none."""
    for item in items:
        path = Path(str(item.path))
        # A test outside tests/ (a session with this conftest as a plugin) has no folder tier.
        folder = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
        if folder in FOLDER_TIERS:
            item.add_marker(FOLDER_TIERS[folder])
        if item.get_closest_marker("process") or item.get_closest_marker("cluster"):
            if not item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.slow)
    items[:] = longest_modules_first(items)


def longest_modules_first(items: list) -> list:
    """Modules of cluster tests, then of process tests, then the rest; within each group the
    modules with more tests first (pytest-xdist's own order, which --no-loadscope-reorder in
    setup.cfg hands over to this one). --dist loadscope gives whole modules to whichever
    worker is free in this order: the minutes-long cluster modules, few tests each, start
    first, so that both workers end on short ones instead of one waiting for the other's."""

    def weight(item) -> int:
        return 2 if item.get_closest_marker("cluster") else 1 if item.get_closest_marker("process") else 0

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    weights: dict[str, int] = {}
    counts: dict[str, int] = {}
    for item in items:
        weights[module(item)] = max(weights.get(module(item), 0), weight(item))
        counts[module(item)] = counts.get(module(item), 0) + 1
    order = {name: index for index, name in enumerate(weights)}
    return sorted(items, key=lambda item: (-weights[module(item)], -counts[module(item)], order[module(item)]))


@pytest.fixture(scope="session")
def mirrored():
    """The two-replica MirroredStrategy (build_strategy keeps one per device
    list and process: see engine/strategy.py)."""

    import engine

    return engine.build_strategy("mirrored", cpu_devices=TEST_CPU_DEVICES)


@pytest.fixture(scope="session")
def default():

    import engine

    return engine.build_strategy("default")


@pytest.fixture
def launch():
    """Starts `python -m engine.launch ...` (a `helpers.Launched`); every
    process group it started is killed at the end of the test."""
    from helpers import Launched

    started: list[Launched] = []

    def start(*args: str, **kwargs) -> Launched:
        started.append(Launched(*args, **kwargs))
        return started[-1]

    yield start
    for launched in started:
        launched.kill_all()


@pytest.fixture
def workers(tmp_path):
    """Starts `engine.main` tasks directly (no launcher that could stop the others), each in its
    own process group with its output in a file; every group is killed at the end, whatever the
    test left running."""
    import subprocess
    import sys

    from helpers import REPO, kill_group, python_env

    started: list[tuple[subprocess.Popen, Path]] = []

    def start(*flags: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"task{len(started)}.log"
        with open(log, "w") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.main", *flags],
                cwd=REPO,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=python_env(),
                process_group=0,
            )
        started.append((process, log))
        return started[-1]

    yield start
    for process, _ in started:
        kill_group(process)
