"""What a user sees: `--help` lists the engine's flags at once and exits 0, a run's output
holds none of TensorFlow's C++ start-up lines unless TF_CPP_MIN_LOG_LEVEL asks for them, and
the launcher checks engine.main's flags without importing TensorFlow; a run and a data service
process import none of Keras's optional libraries. Real processes.

Covers: engine/lean_imports.py, engine/native_logs.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import NATIVE_START_UP_LINES

from engine.lean_imports import HIDDEN
from engine.native_logs import kept_lines

REPO = Path(__file__).resolve().parents[2]  # The repository, above tests/process.
# Under load (2 shared cores) Python alone starts in ~0.3 s; TensorFlow's import takes 5-10 s.
HELP_SECONDS = 4.0


def python(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    environment.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("command", "flag"),
    [("engine.main", "--help"), ("engine.main", "--helpfull"), ("engine.launch", "--help")],
)
def test_help_lists_the_flags_quickly_and_exits_0(command, flag):
    """--help is the usage text (tests/cli/test_help.py); --helpfull the usage and every flag with its help."""
    began = time.monotonic()
    result = python("-X", "importtime", "-m", command, flag)
    seconds = time.monotonic() - began
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: python -m {command} "), result.stdout[:200]
    names = (
        ["--num_workers", "--rendezvous", "--max_restarts"]
        if command == "engine.launch"
        else ["--strategy", "--model_dir", "--ema_decay", "--histogram_every", "--worker_hosts"]
    )
    for name in names:  # --helpfull: `  --name=default` and its help below; --help: the name, or in its group.
        assert (
            re.search(rf"^  {name}\b.*\n      \S", result.stdout, re.M)
            if flag == "--helpfull"
            else re.search(rf"{name}\b", result.stdout)
        ), name
    assert "tensorflow" not in result.stderr  # -X importtime: the help imported no TensorFlow
    assert seconds < HELP_SECONDS, seconds


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_prints_no_native_start_up_lines_unless_asked_and_imports_no_optional_library(tmp_path):
    """One run answers both: no C++ start-up line reaches its output, and scikit-learn, IPython,
    matplotlib, pandas and scipy, which cost each engine.main about 1.6 s of CPU at the imports of
    Keras and TensorFlow (engine.lean_imports), and boto3 and fsspec, 0.3 s more at
    TensorBoard's, are never loaded by a run that needs none of them, not even for the default data
    (scikit-learn's digits, read from its file: input/digits.py). Loaded means in `sys.modules` when the process
    exits (a sitecustomize reports it): import times cannot tell a hidden package that was tried
    from one that loaded, since a garbage collection or another thread can land in either."""
    from helpers import in_background, read_scalars

    flags = ["-m", "engine.main", "--model=mlp", "--train_steps=2", "--steps_per_loop=1", "--mode=train"]
    verbose = in_background(python, *flags, env={"TF_CPP_MIN_LOG_LEVEL": "0"})  # Both processes at once.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(MODULES_AT_EXIT_REPORTER)
    # engine.main's default: TF_CPP_MIN_LOG_LEVEL=2; the default data, digits, read without scikit-learn.
    quiet = python(*flags, f"--model_dir={tmp_path / 'run'}", env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"})
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "Total params" in quiet.stdout + quiet.stderr  # The engine's own start-up output is there.
    lines = quiet.stderr.splitlines()
    reports = [line.split(" ", 1)[1] for line in lines if line.startswith("MODULES_AT_EXIT ")]
    logged = [line for line in lines if not line.startswith("MODULES_AT_EXIT ")]
    leaked = [line for line in logged if any(s in line for s in NATIVE_START_UP_LINES)]
    assert leaked == []
    assert "Saved checkpoint" in quiet.stderr and "Sharding callback duration" not in quiet.stderr
    assert "done: step 2, eval none, " in quiet.stderr  # --mode=train: no evaluation to report.
    # The process ends without the interpreter's finalization (main_command.exit_process): what the
    # run wrote last, the goodput scalars after the final step, is on disk all the same.
    scalars = read_scalars(tmp_path / "run" / "train")
    assert set(scalars["loss"]) == {1, 2} and set(scalars["goodput/fraction"]) == {2}
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["global_step"] == 2
    assert len(reports) == 1, quiet.stderr[-3000:]
    modules = set(reports[0].split())
    # Keras's wrappers (which try scikit-learn) and array slicing (pandas), TensorFlow's legacy
    # Keras (scipy) and TensorBoard's file-system stub (which tries boto3 and fsspec) were imported:
    # the hidden packages were asked for, and refused.
    assert {
        "tensorflow",
        "keras.src.wrappers",
        "keras.src.trainers.data_adapters.array_slicing",
        "tensorflow.python.keras.engine.training_arrays_v1",
        "tensorboard.compat.tensorflow_stub.io.gfile",
    } <= modules
    loaded = sorted(name for name in modules if name.split(".")[0] in HIDDEN)
    assert loaded == []
    verbose = verbose.result()
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "InitializeLog" in verbose.stderr  # Asked for: nothing held back.


# Written as a sitecustomize.py: prints the names in sys.modules, on one line, as the process exits.
MODULES_AT_EXIT_REPORTER = """
import atexit
import sys


def _report():
    sys.stderr.write("MODULES_AT_EXIT " + " ".join(sorted(sys.modules)) + "\\n")
    sys.stderr.flush()


atexit.register(_report)
"""


# The same report where a process ends by os._exit (past its exit handlers), as the servers do.
MODULES_AT_OS_EXIT_REPORTER = (
    MODULES_AT_EXIT_REPORTER
    + """
import os

_exit = os._exit


def _report_then_exit(status):
    _report()
    _exit(status)


os._exit = _report_then_exit
"""
)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_data_service_process_imports_no_optional_library(tmp_path):
    """`python -m engine.data_service` imports TensorFlow as engine.main does: a dispatcher that
    served and was stopped never loaded scikit-learn, pandas, scipy, IPython or matplotlib."""
    from helpers import read_until

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(MODULES_AT_OS_EXIT_REPORTER)
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.data_service", "--dispatcher", "--port=0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_until(process.stderr, "dispatcher serving at", timeout=90, process=process)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    reports = [line.split(" ", 1)[1] for line in stderr.splitlines() if line.startswith("MODULES_AT_EXIT ")]
    assert len(reports) == 1, stderr[-3000:]
    modules = set(reports[0].split())
    assert {"tensorflow", "keras.src.wrappers"} <= modules  # Keras imported: its wrappers tried scikit-learn.
    assert sorted(name for name in modules if name.split(".")[0] in HIDDEN) == []


def test_only_native_log_lines_are_held_back():
    text = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1796043263.123665    8024 cpu_feature_guard.cc:227] This TensorFlow binary ...\n"
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
        "appropriate compiler flags.\n"
        "E0000 00:00:1796043271.934405    8024 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n"
        "/x.py:3: UserWarning: a Python warning\n"
        "Traceback (most recent call last):\n"
    )
    python_lines = "/x.py:3: UserWarning: a Python warning\nTraceback (most recent call last):\n"
    assert kept_lines(text, 2) == python_lines
    assert (
        kept_lines(text, 1)
        == text.splitlines(keepends=True)[0] + text.splitlines(keepends=True)[3] + python_lines
    )
    assert kept_lines(text, 0) == text
    # A fatal line, the last word of a process about to abort, is never held back.
    fatal = "F0000 00:00:1796043271.934405    8024 op_kernel.cc:99] Check failed: size >= 0\n"
    assert kept_lines(text + fatal, 3) == python_lines + fatal
    # absl's Python logging has the C++ form but names a .py file: the engine's own line (a signal
    # that ends the process during the import: the only word it leaves), kept.
    engine_line = "W1205 11:58:01.123456 140212 preemption.py:150] SIGHUP received: exiting now, status 129\n"
    assert kept_lines(text + engine_line, 2) == python_lines + engine_line


_FAKE_TENSORFLOW = """
import os, sys
print("a Python line of the import", file=sys.stderr, flush=True)
os.write(2, b"I0000 00:00:1796043263.123665    8024 port.cc:153] a native start-up line\\n")
os.write(2, b"the last line, without its newline")
if os.environ.get("DIE_IN_THE_IMPORT"):
    os._exit(131)
class config:
    list_physical_devices = staticmethod(lambda: [])
"""


@pytest.mark.parametrize("dies", [False, True], ids=["imports", "dies_in_the_import"])
def test_what_the_import_window_prints_reaches_stderr_in_order_even_when_the_process_dies_there(tmp_path, dies):
    """A task that died inside TensorFlow's import (exit 131 in CI, twice) printed nothing:
    the window's output waited in a temporary file read only after the import."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(_FAKE_TENSORFLOW)
    program = (
        "import sys\n"
        "from engine.native_logs import import_tensorflow_quietly\n"
        "import_tensorflow_quietly()\n"
        "print('after the window', file=sys.stderr)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", **({"DIE_IN_THE_IMPORT": "1"} if dies else {})}
    result = python("-c", program, env=env, timeout=60)
    window = "a Python line of the import\nthe last line, without its newline"
    assert (result.returncode, result.stderr) == ((131, window) if dies else (0, window + "after the window\n"))


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_launcher_checks_engine_main_flags_without_importing_tensorflow():
    began = time.monotonic()
    result = python("-X", "importtime", "-m", "engine.launch", "--num_workers=1", "--", "--train_steps=abc")
    seconds = time.monotonic() - began
    assert result.returncode == 2
    assert "the flags after -- are not engine.main's" in result.stderr
    assert "tensorflow" not in result.stderr and "keras" not in result.stderr
    assert seconds < HELP_SECONDS, seconds


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_stop_signal_during_the_start_up_ends_the_run_with_one_line_naming_its_sender(tmp_path):
    """A SIGHUP (or SIGTERM) before anything trained ends engine.main at once with 128 + N. Sent
    inside TensorFlow's import window (stderr through the reader that holds the native start-up
    lines back), its line was held back too: runs in the suite ended with 129 or 131 and nothing
    printed. The line gets through and names who sent it."""
    import signal

    from helpers import popen_main, stop

    process = popen_main("--model=mlp", "--train_steps=100000", f"--model_dir={tmp_path / 'run'}")
    try:
        stderr_at_start = os.readlink(f"/proc/{process.pid}/fd/2")
        deadline = time.monotonic() + 60
        # In the window: the watcher owns the stop signals and fd 2 is the reader's pipe.
        while not (_blocks(process.pid, signal.SIGHUP) and _stderr_of(process.pid) not in (stderr_at_start, "")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGHUP)
        _, stderr = process.communicate(timeout=60)
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGHUP, stderr[-3000:]
    assert f"SIGHUP received: exiting now with status 129 (sent by pid {os.getpid()}: " in stderr, stderr[-3000:]


def _blocks(pid: int, signum: int) -> bool:
    """Whether the process's main thread has `signum` blocked (/proc/PID/status, SigBlk)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(mask & (1 << (signum - 1)))


def _stderr_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return ""
