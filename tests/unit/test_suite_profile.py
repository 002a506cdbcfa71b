"""tests/suite_profile.py: the module table and the waits it prints from the workers' rows, and
the stacks of a test still running past the stall time."""

import io
import time

from suite_profile import _StallWatch, summary


def test_the_summary_ranks_modules_by_cpu_and_tests_by_time_waited(tmp_path):
    (tmp_path / "gw0.tsv").write_text(
        "tests/a.py::one\t10.00\t1.00\t0.50\t0\n"  # waited 8.5 s
        "tests/b.py::two\t20.00\t3.00\t0.00\t0\n"  # the longest, not the costliest
    )
    (tmp_path / "gw1.tsv").write_text("tests/a.py::three\t2.00\t0.00\t2.00\t0\n")
    lines = summary(str(tmp_path)).splitlines()
    assert lines[1].split() == ["12.0", "1.0", "2.5", "2", "tests/a.py"]  # 3.5 CPU-s: first
    assert lines[2].split() == ["20.0", "3.0", "0.0", "1", "tests/b.py"]
    assert lines[3].split()[:4] == ["32.0", "4.0", "2.5", "3"]
    waits = lines[lines.index("waited without working (wall - CPU, s):") + 1 :]
    assert [line.split() for line in waits] == [
        ["17.0", "tests/b.py::two"],
        ["8.5", "tests/a.py::one"],
        ["0.0", "tests/a.py::three"],
    ]


def _a_test_that_stalls(seconds: float) -> None:
    time.sleep(seconds)


def test_a_test_past_the_stall_time_gets_its_stack_written_and_a_quick_one_none():
    stacks = io.StringIO()
    watch = _StallWatch(stacks, stall_s=0.2)
    watch.begin()
    time.sleep(0.05)
    watch.end()
    time.sleep(0.3)
    assert stacks.getvalue() == ""
    watch.begin()
    _a_test_that_stalls(0.5)
    watch.end()
    dumps = stacks.getvalue()
    assert dumps.count("running for") >= 1  # Two (0.2 s, 0.4 s) on a quiet machine.
    assert "in _a_test_that_stalls" in dumps and "Thread MainThread" in dumps
