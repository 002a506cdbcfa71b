"""tests/suite_profile.py: the module table and the waits it prints from the workers' rows."""

from suite_profile import summary


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
