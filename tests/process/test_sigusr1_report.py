"""SIGUSR1 to a running `engine.main`: a report of what it is doing lands in the model_dir
and the run goes on (the report itself: tests/unit/test_diagnostics.py)."""

from __future__ import annotations

import re
import signal

import pytest
from helpers import UNTIL_STOPPED, popen_main, read_stderr_until, stop


@pytest.mark.timeout(300)
def test_sigusr1_writes_what_the_run_is_doing_and_the_run_goes_on_to_a_normal_stop(tmp_path):
    process = popen_main(*UNTIL_STOPPED, f"--model_dir={tmp_path}")
    report = tmp_path / "diagnostics" / "main.txt"
    try:
        read_stderr_until(process, "step 20/", timeout=240)  # Training is under way.
        process.send_signal(signal.SIGUSR1)
        said = read_stderr_until(process, "the run goes on", timeout=60)
        assert f"wrote what this process is doing to {report}" in said
        later = read_stderr_until(process, "/1000000", timeout=60)  # Another loop's line: it trains on.
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        stop(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped at step" in stderr and "Traceback" not in said + later + stderr
    text = report.read_text()
    step = int(re.search(r"^last completed step: (\d+)$", text, re.MULTILINE).group(1))
    assert step >= 20 and step % 20 == 0, text[:500]
    doing = r"^doing: (train for [\d.]+ s \(a loop from step \d+, training to step 1000000\)|between phases)$"
    assert re.search(doing, text, re.MULTILINE), text[:500]
    assert "MainThread" in text and "signal-watcher" in text
    # The main thread's stack, taken while it was inside the trainer's loop.
    assert "engine/trainer/trainer.py" in text and " in train\n" in text, text[-3000:]
    assert [p.name for p in report.parent.iterdir()] == ["main.txt"]  # No temporary file left.
