"""The command-line-against-library benchmark's arithmetic: which side goes first, the wall
rate from the loops' ends, the medians, ratios and per-loop milliseconds. (A tiny run of both
sides: tests/process/test_benchmarks.py.) No timing is asserted: these machines are shared."""

import pytest

from benchmarks import cli_vs_library


def test_the_sides_alternate_which_goes_first():
    assert [cli_vs_library.order(repeat) for repeat in range(3)] == [
        ("cli", "library"),
        ("library", "cli"),
        ("cli", "library"),
    ]


def test_the_wall_rate_runs_from_the_first_loops_end_to_the_last():
    ends = [(50, 100.0), (100, 100.5), (150, 101.25)]
    assert cli_vs_library.wall_rate(ends, global_batch_size=64) == pytest.approx(100 * 64 / 1.25)
    assert cli_vs_library.wall_rate(ends[:1], global_batch_size=64) is None


def _run(repeat, side, steady, wall):
    return {"repeat": repeat, "side": side, "steady": steady, "wall": wall, "cpu": None}


def test_the_summary_compares_medians_and_each_repeats_pair():
    records = [
        _run(1, "cli", 900.0, 800.0),
        _run(1, "library", 1000.0, 1000.0),
        _run(2, "library", 1200.0, 1000.0),
        _run(2, "cli", 1200.0, 1000.0),
        _run(3, "cli", 1000.0, 900.0),
        _run(3, "library", 1000.0, 1000.0),
    ]
    summary = cli_vs_library.summarize(records, examples_per_loop=3200)
    steady = summary["steady"]
    assert steady["cli_median"] == 1000.0 and steady["library_median"] == 1000.0
    assert steady["ratio_of_medians"] == 1.0 and steady["median_pair_ratio"] == 1.0  # 0.9, 1.0, 1.0
    assert steady["per_loop_ms"] == 0.0
    wall = summary["wall"]
    assert wall["ratio_of_medians"] == pytest.approx(0.9)
    assert wall["per_loop_ms"] == pytest.approx((3200 / 900 - 3200 / 1000) * 1000)  # 355.6 ms a loop
    assert "the cli adds 355.56 ms a loop" in cli_vs_library.format_table(records, summary)
    assert summary["cpu"]["ratio_of_medians"] is None  # No figure: none made up.
