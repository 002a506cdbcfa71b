"""What `engine.main` prints (engine.cli.process.console, engine.cli.run.summary, engine.status_line): a line
is its message unless --log_prefix asks for absl's prefix; the progress bar on a terminal never
shares a line with a log line; a summary table with metrics.json's figures ends a run; in a
cluster only the chief prints INFO lines and every worker its done line (asserted on a real
cluster's output in tests/cluster/test_multi_worker.py).

Covers: engine/cli/run/summary.py, engine/status_line.py.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time

import pytest
from helpers import REPO, main_in_process, python_env

from engine.callbacks.progress import human_number
from engine.cli.config.settings import RunConfig
from engine.cli.process.console import Console, configured
from engine.cluster import Cluster
from engine.logger import EVERY_TASK
from engine.status_line import StatusLine

ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] ")
BAR = re.compile(r"\d+/\d+ \[[=>.]+\]")
TINY = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=32", "--steps_per_loop=2"]
WORKERS = {"worker": ("localhost:1", "localhost:2")}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows after `raw`: \\r returns to the line's start, ESC[2K erases the
    line, other characters overwrite from the cursor on."""
    lines, line, column = [], "", 0
    for token in re.findall(r"\x1b\[2K|\x1b\[[0-9;]*[A-Za-z]|\r|\n|[^\r\n\x1b]+", raw):
        if token == "\n":
            lines.append(line)
            line, column = "", 0
        elif token == "\r":
            column = 0
        elif token == "\x1b[2K":
            line = ""
        elif not token.startswith("\x1b"):
            line = line[:column] + token + line[column + len(token) :]
            column += len(token)
    return lines + ([line] if line else [])


@pytest.fixture
def root_lines():
    """A stream handler on the root logger, as absl's is in engine.main; its text."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def test_lines_are_their_message_with_a_marker_for_warnings_and_errors(root_lines):
    with configured(Console()):
        logging.info("step 2/4  loss=1.5")
        logging.warning("a warning")
        logging.error("an error")
    logging.info("after")  # The handler's own format again.
    assert root_lines.getvalue().splitlines() == [
        "step 2/4  loss=1.5",
        "warning: a warning",
        "error: an error",
        "after",
    ]


def test_a_worker_that_is_not_the_chief_prints_warnings_and_its_done_line_prefixed(root_lines):
    config = RunConfig()
    worker = Console.for_run(config.schedule, Cluster(WORKERS, "worker", 1))
    assert (worker.task_prefix, worker.speaks) == ("[worker:1] ", False)
    for chief in (None, Cluster(WORKERS, "worker", 0), Cluster({**WORKERS, "chief": ("c:1",)}, "chief", 0)):
        assert Console.for_run(config.schedule, chief) == Console()
    assert (
        Console.for_run(config.schedule, Cluster({**WORKERS, "evaluator": ("e:1",)}, "evaluator", 0))
        == Console()
    )
    with configured(worker):
        logging.info("step 2/4  loss=1.5")
        logging.warning("stopped at step 2")
        logging.info("done: step 4, eval none; weights_digest=abc", extra=EVERY_TASK)
        logging.error("two\nlines")
    assert root_lines.getvalue().splitlines() == [
        "[worker:1] warning: stopped at step 2",
        "[worker:1] done: step 4, eval none; weights_digest=abc",
        "[worker:1] error: two",
        "[worker:1] lines",
    ]
    everything = Console.for_run(RunConfig(log_all_tasks=True).schedule, Cluster(WORKERS, "worker", 1))
    assert everything.task_prefix == "[worker:1] " and everything.speaks and not everything.speaks_for_the_run


def test_a_log_line_clears_the_bar_and_the_bar_is_drawn_again_below_it():
    terminal = _Terminal()
    line = StatusLine()
    line.show("3/10 [=====>....]  loss: 0.5000", terminal)
    with line.suspended():  # What every console handler does around a line.
        terminal.write("eval at step 3  loss=0.5\n")
    assert _screen(terminal.getvalue()) == ["eval at step 3  loss=0.5", "3/10 [=====>....]  loss: 0.5000"]
    line.show("6/10 [=======>..]  loss: 0.4000", terminal)
    line.clear()
    assert _screen(terminal.getvalue()) == ["eval at step 3  loss=0.5"]  # Above the bar, then the bar erased.
    muted = StatusLine()
    muted.muted = True
    assert line.wanted(terminal) and not muted.wanted(terminal) and not line.wanted(io.StringIO())


def test_the_library_logs_above_the_bar_too():
    """Research code: the engine's own handler (engine.logger) prints above the bar."""
    from engine import logger as engine_logger
    from engine.status_line import status_line

    terminal = _Terminal()
    handler = engine_logger._AboveTheBar(terminal)
    status_line.show("3/10 [=====>....]", terminal)
    try:
        handler.emit(
            logging.LogRecord("engine", logging.INFO, __file__, 1, "Saved checkpoint ckpt-3", None, None)
        )
    finally:
        status_line.clear()
    assert _screen(terminal.getvalue()) == ["Saved checkpoint ckpt-3"]
    assert "\x1b[2K3/10 [=====>....]" in terminal.getvalue().split("Saved checkpoint ckpt-3")[1]  # Drawn again.


@pytest.mark.cli
def test_no_absl_prefix_by_default_and_the_prefix_with_log_prefix(tmp_path):
    flags = [*TINY, "--train_steps=4", "--mode=train"]
    plain = main_in_process(*flags, f"--model_dir={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr[-3000:]
    progress = [line for line in plain.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/4", "4/4"], plain.stderr[-3000:]
    assert not any(ABSL_PREFIX.match(line) for line in plain.stderr.splitlines()), plain.stderr[-3000:]
    assert re.search(r"^done: step 4, eval none, ", plain.stderr, re.M)

    prefixed = main_in_process(*flags, "--log_prefix", f"--model_dir={tmp_path / 'prefixed'}")
    assert prefixed.returncode == 0, prefixed.stderr[-3000:]
    progress = [line for line in prefixed.stderr.splitlines() if "] step " in line]
    assert len(progress) == 2 and all(ABSL_PREFIX.match(line) for line in progress), prefixed.stderr[-3000:]
    assert re.search(r"^I\d{4} .*job\.py:\d+\] done: step 4, eval none, ", prefixed.stderr, re.M)


@pytest.mark.cli
def test_a_copied_model_dirs_summary_is_escaped_and_names_where_it_is_now(tmp_path):
    """metrics.json is text of a model_dir that may come from someone else: a metric name holding
    an escape sequence and a forged error line reaches the screen escaped, and a copy's summary
    names the copy, not the directory its metrics.json was written in."""
    import shutil

    original, copy = tmp_path / "run", tmp_path / "copy"
    trained = main_in_process(*TINY, "--train_steps=2", f"--model_dir={original}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    shutil.copytree(original, copy)
    shutil.rmtree(original)  # Nothing may name it now.
    record = json.loads((copy / "metrics.json").read_text())
    assert record["model_dir"] == str(original)
    forged = "\x1b[2J\x1b[31mred\rengine.main: error: forged\nengine.main: error: forged"
    record["train"][forged] = 1.0
    record["exit_status"] = 7  # Not the rerun's status: a model_dir's record is data.
    (copy / "metrics.json").write_text(json.dumps(record))
    rerun = main_in_process(*TINY, "--train_steps=2", f"--model_dir={copy}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "nothing to train" in rerun.stderr
    assert "\x1b" not in rerun.stderr and "\r" not in rerun.stderr
    assert not [line for line in rerun.stderr.splitlines() if line.startswith("engine.main: error:")]
    rows = _summary(rerun.stderr)
    escaped = "\\x1b[2J\\x1b[31mred\\rengine.main: error: forged\\nengine.main: error: forged"
    assert rows[escaped] == ["1", "-"], rows  # Its train figure; no eval figure.
    assert rows["model_dir"] == [str(copy)] and rows["metrics.json"] == [str(copy / "metrics.json")]
    assert str(original) not in rerun.stderr[rerun.stderr.index("\nsummary\n") :]


def _summary(stderr: str) -> dict[str, list[str]]:
    """The summary table's rows: {first cell: the other cells}, cells apart by two spaces or more;
    the header row (no first cell) under ''."""
    lines = stderr[stderr.index("\nsummary\n") + len("\nsummary\n") :].splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines:
        if not line.startswith("  "):
            break
        cells = re.split(r"\s{2,}", line.strip())
        if not rows:  # The header row: no name in the first column.
            rows[""] = cells
            continue
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.cli
def test_the_summary_table_shows_metrics_json_figures(tmp_path):
    model_dir = tmp_path / "run"
    result = main_in_process(
        *TINY,
        "--train_steps=6",
        "--eval_every=3",
        "--best_checkpoint_metric=loss",
        f"--export_dir={tmp_path / 'export'}",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    # The banner: a line a concern, none over 80 columns into a pipe but a single field (a long path is
    # printed whole, on a line of its own: under xdist tmp_path alone is about 80 columns).
    banner = result.stderr[result.stderr.index("strategy=") : result.stderr.index("\nmodel mlp:")].splitlines()
    assert len(banner) >= 5, banner
    assert all(len(line) <= 80 or "  " not in line.strip() for line in banner), banner
    done = next(i for i, line in enumerate(lines) if line.startswith("done: step 6, eval loss="))
    assert lines[done + 1] == "summary"  # The done line first, the table after it.
    metrics = json.loads((model_dir / "metrics.json").read_text())
    best = json.loads((model_dir / "best" / "best.json").read_text())
    rows = _summary(result.stderr)
    assert rows[""] == ["train", "eval"]
    for name in ("loss", "accuracy"):
        assert rows[name] == [f"{metrics['train'][name]:.4g}", f"{metrics['eval'][name]:.4g}"], rows
    assert rows["num_examples"] == ["-", str(metrics["eval"]["num_examples"])]
    assert rows["learning_rate"] == [f"{metrics['train']['learning_rate']:.4g}", "-"]
    assert "examples_per_second" not in rows and "steps_per_second" not in rows  # One loop's rates.
    assert rows["step"] == [str(metrics["global_step"])] == ["6"]
    # The mlp's FLOPs are counted, but on a CPU without --peak_tflops its TFLOP/s are not shown.
    assert metrics["train"]["tflops"] > 0
    assert rows["throughput"] == [f"{human_number(metrics['examples_per_second'])} examples/s"]
    assert rows["goodput"][0].startswith(f"{metrics['goodput']['fraction']:.2f}: train "), rows
    assert rows["best checkpoint"] == [
        f"loss={best['value']:.4g} at step {best['step']}: {model_dir / 'best' / best['checkpoint']}"
    ]
    assert rows["model_dir"] == [str(model_dir)] and rows["metrics.json"] == [str(model_dir / "metrics.json")]
    assert rows["export_dir"] == [str(tmp_path / "export")]
    assert rows["TensorBoard"] == [f"tensorboard --logdir {model_dir}"]

    evaluated = main_in_process(*TINY, "--mode=eval", f"--model_dir={model_dir}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = json.loads((model_dir / "metrics.json").read_text())["evaluations"][-1]
    rows = _summary(evaluated.stderr)
    assert rows[""] == ["eval"] and rows["loss"] == [f"{last['eval']['loss']:.4g}"] and "throughput" not in rows
    assert rows["step"] == [str(last["step"])]


def test_the_banner_names_devices_short():
    from engine.cli.run.job import short_device_name

    assert short_device_name("/job:localhost/replica:0/task:0/device:CPU:1") == "CPU:1"
    assert short_device_name("/job:worker/replica:0/task:1/device:GPU:0") == "worker:1/GPU:0"


def _run_on_a_terminal(*flags: str, timeout: float = 240, columns: int = 80) -> str:
    """`python -m engine.main FLAGS` with stdout and stderr on one pty, `columns` wide, as in a
    terminal; everything it wrote there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.main", *flags],
        cwd=REPO,
        env=python_env(),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal.
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif process.poll() is not None:
                break
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    assert process.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_progress_bar_never_shares_a_line_with_a_log_line_on_a_terminal():
    """On an 80-column terminal: nothing wraps (no line reaches the last column; a short model_dir,
    as a path is printed whole), the bar and the lines never share a line."""
    with tempfile.TemporaryDirectory(prefix="t", dir="/tmp") as model_dir:
        raw = _run_on_a_terminal(
            *TINY, "--train_steps=12", "--log_every=4", "--eval_every=6", f"--model_dir={model_dir}/r"
        )
    screen_lines = _screen(raw)
    assert max(len(line) for line in screen_lines) < 80, [line for line in screen_lines if len(line) >= 80]
    assert len(BAR.findall(raw)) >= 5, raw[-3000:]  # Drawn at every loop: steps 2, 4, ... 12.
    screen = _screen(raw)
    bars = [line for line in screen if BAR.search(line)]
    assert len(bars) == 1 and bars[0].startswith("12/12 ["), screen  # The full bar, on a line of its own.
    progress = [line for line in screen if re.search(r"step \d+/12 ", line)]
    assert [line.split()[1] for line in progress] == ["4/12", "8/12", "12/12"], screen
    assert all(re.fullmatch(r"step \d+/12  loss=\S+ .*  eta=\S+", line) for line in progress), progress
    evaluations = [line for line in screen if "eval at step" in line]
    assert [line.split()[3] for line in evaluations] == ["6", "12"] and all(
        line.startswith("eval at step ") for line in evaluations
    ), screen
    assert any(line.startswith("done: step 12, ") for line in screen) and "summary" in screen
