"""Smoke tests of the throughput benchmark and the sweep, in tiny configurations.

They run the scripts as users do (a subprocess each: logical CPU devices must
be set before TensorFlow starts) and check what they write. No timing is
asserted: these machines are shared and noisy.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, signal_group


def _run(args, timeout):
    """Runs the script in its own process group, so that a timeout also ends
    the children it started (the sweep runs one per device count)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        signal_group(process)  # whatever is left of the group
        if process.poll() is None:
            process.communicate(timeout=30)
    completed = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


@pytest.mark.process
@pytest.mark.timeout(400)
def test_throughput_writes_json_with_a_row_per_runner(tmp_path):
    out = tmp_path / "out.json"
    completed = _run(
        [
            "benchmarks.throughput",
            "--model=mlp",  # Its rows' fields are any model's; the mlp traces and steps in less CPU.
            "--strategy=default",
            "--runners=engine,engine_stream,fit,raw",
            "--global_batch_size=16",
            "--steps_per_loop=2",
            "--warmup_steps=2",
            "--steps=4",
            "--repeats=1",
            "--peak_matmul_size=128",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())

    assert set(payload) >= {"results", "ratios", "peak_tflops", "machine"}
    assert isinstance(payload["peak_tflops"], float) and payload["peak_tflops"] > 0
    assert isinstance(payload["machine"], dict) and payload["machine"]
    assert set(payload["ratios"]) >= {"engine/fit", "engine/raw"}
    for value in (payload["ratios"]["engine/fit"], payload["ratios"]["engine/raw"]):
        assert value is None or (isinstance(value, float) and value > 0)

    rows = payload["results"]
    assert [row["runner"] for row in rows] == ["engine", "engine_stream", "fit", "raw"]
    # The engine keeps the in-memory split on the devices, as the CLI does; _stream reads it through tf.data.
    assert (rows[0]["input"], rows[1]["input"]) == ("resident", "tf.data")
    stream_ratio = payload["ratios"]["engine_stream/raw"]
    assert stream_ratio == rows[1]["examples_per_second"] / rows[3]["examples_per_second"]
    types = {
        "runner": str,
        "model": str,
        "strategy": str,
        "examples_per_second": float,
        "min": float,
        "max": float,
        "global_batch_size": int,
        "replicas": int,
        "mixed_precision": str,
        "jit_compile": bool,
        "flops_per_example": int,
        "achieved_tflops": float,
    }
    for row in rows:
        for key, kind in types.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert row["error"] is None, row  # a crashed runner fails the test
        assert row["examples_per_second"] > 0, row
        assert row["model"] == "mlp" and row["strategy"] == "default"
        assert row["global_batch_size"] == 16 and row["replicas"] == 1
        assert row["flops_per_example"] > 0
    # The plain table goes to stdout.
    assert "engine" in completed.stdout and "ratios:" in completed.stdout


@pytest.mark.process
@pytest.mark.timeout(400)
def test_throughput_tfrecord_mode_reads_files_with_engine_and_tfdata(tmp_path):
    out, records = tmp_path / "out.json", tmp_path / "records"
    _run(
        [
            "benchmarks.throughput",
            "--model=mlp",
            "--data=tfrecord",
            f"--tfrecord_dir={records}",
            "--tfrecord_examples=64",
            "--tfrecord_files=2",
            "--runners=engine,tfdata",
            "--global_batch_size=16",
            "--steps_per_loop=2",
            "--warmup_steps=2",
            "--steps=4",
            "--repeats=1",
            "--peak_matmul_size=0",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())

    data = payload["data"]
    assert data["mode"] == "tfrecord" and data["directory"] == str(records)
    assert (data["records"], data["files"], data["written"], data["kept"]) == (64, 2, True, True)
    assert data["file_names"] == ["train-00000-of-00002", "train-00001-of-00002"]
    assert data["image_shape"] == [28, 28, 1]  # the mlp's input
    assert sorted(p.name for p in records.iterdir()) == ["benchmark_records.json", *data["file_names"]]
    rows = payload["results"]
    assert [(row["runner"], row["kind"]) for row in rows] == [("engine", "engine"), ("tfdata", "tfdata")]
    for row in rows:
        assert row["error"] is None, row
        assert isinstance(row["examples_per_second"], float) and row["examples_per_second"] > 0, row
        assert row["replicas"] == 1 and row["global_batch_size"] == 16
    assert rows[0]["input"] == "tf.data"  # Files: the engine streams them.
    ratio = payload["ratios"]["engine/tfdata"]
    assert isinstance(ratio, float) and ratio == rows[0]["examples_per_second"] / rows[1]["examples_per_second"]
    assert (payload["ratios"]["engine/fit"], payload["ratios"]["engine/raw"]) == (None, None)


def test_tfrecord_files_are_reused_rewritten_or_refused(tmp_path):
    from benchmarks.throughput import BenchConfig, check_config, prepare_records

    config = BenchConfig(data="tfrecord", tfrecord_dir=str(tmp_path), tfrecord_examples=20, tfrecord_files=3)
    first = prepare_records(config, (6, 6, 1), str(tmp_path))
    assert first["written"] and first["file_names"] == [f"train-0000{i}-of-00003" for i in range(3)]
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    again = prepare_records(config, (6, 6, 1), str(tmp_path))
    assert not again["written"] and {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps

    other = BenchConfig(data="tfrecord", tfrecord_dir=str(tmp_path), tfrecord_examples=30, tfrecord_files=2)
    rewritten = prepare_records(other, (6, 6, 1), str(tmp_path))
    assert rewritten["written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "benchmark_records.json",
        "train-00000-of-00002",
        "train-00001-of-00002",
    ]
    import tensorflow as tf

    assert sum(1 for _ in tf.data.TFRecordDataset([str(p) for p in sorted(tmp_path.glob("train-*"))])) == 30

    (tmp_path / "train-mine").write_bytes(b"a user's own file")
    with pytest.raises(ValueError, match="holds files the benchmark did not write \\(train-mine\\)"):
        prepare_records(other, (6, 6, 1), str(tmp_path))
    assert (tmp_path / "train-mine").read_bytes() == b"a user's own file"

    with pytest.raises(ValueError, match="--data=tfrecord"):
        check_config(BenchConfig(runners=("engine", "tfdata")))


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_vs_library_runs_both_sides_alternating_on_the_same_model_and_data(tmp_path):
    out = tmp_path / "out.json"
    completed = _run(
        [
            "benchmarks.cli_vs_library",
            "--model=mlp",
            "--repeats=2",
            "--train_steps=6",
            "--steps_per_loop=2",
            "--global_batch_size=32",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    order = [(run["repeat"], run["side"]) for run in runs]
    assert order == [(1, "cli"), (1, "library"), (2, "library"), (2, "cli")]  # Which goes first alternates.
    for run in runs:
        assert run["global_step"] == 6 and run["steady"] > 0 and run["wall"] > 0 and run["cpu"] > 0, run
    # The same model, data, seed and steps: the same training on both sides.
    losses = {run["side"]: run["loss"] for run in runs if run["repeat"] == 1}
    assert losses["cli"] == pytest.approx(losses["library"], rel=1e-5), losses
    steady = payload["summary"]["steady"]
    assert steady["ratio_of_medians"] == pytest.approx(steady["cli_median"] / steady["library_median"])
    assert "cli/library" in completed.stdout


@pytest.mark.process
@pytest.mark.timeout(400)
def test_sweep_writes_png_and_markdown(tmp_path):
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "sweep"
    _run(
        [
            "benchmarks.sweep",
            f"--out_dir={out_dir}",
            "--model=mlp",
            "--steps_per_loop_values=1,2",
            "--replica_values=1,2",
            "--sweep_steps_per_loop=2",
            "--global_batch_size=16",
            "--steps=4",
            "--warmup_steps=2",
            "--repeats=1",
        ],
        timeout=360,
    )
    png = out_dir / "sweep.png"
    markdown = (out_dir / "sweep.md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| steps_per_loop |" in markdown and "| replicas |" in markdown
    assert markdown.count("| engine |") == 4 and markdown.count("| raw |") == 4
    records = json.loads((out_dir / "sweep.json").read_text())["records"]
    assert {(r["sweep"], r["x"]) for r in records} == {
        ("steps_per_loop", 1),
        ("steps_per_loop", 2),
        ("replicas", 1),
        ("replicas", 2),
    }
    assert [r for r in records if r["error"] is not None or not r["examples_per_second"] > 0] == []
    assert {r["replicas"] for r in records if r["sweep"] == "replicas"} == {1, 2}


@pytest.mark.process
@pytest.mark.timeout(400)
def test_checkpoint_benchmark_writes_blocking_times_and_slowdowns(tmp_path):
    out = tmp_path / "checkpoint.json"
    model_dir = tmp_path / "checkpoints"
    completed = _run(
        [
            "benchmarks.checkpoint",
            "--model=mlp",
            "--global_batch_size=16",
            "--saves=2",
            "--steps=4",
            "--checkpoint_every=2",
            "--repeats=1",
            f"--model_dir={model_dir}",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())
    for key in ("sync_blocking_s", "async_blocking_s", "blocking_ratio", "sync_slowdown", "async_slowdown"):
        assert isinstance(payload[key], float), (key, payload[key])
    assert payload["sync_blocking_s"] > 0 and payload["async_blocking_s"] > 0
    assert payload["blocking_ratio"] == payload["async_blocking_s"] / payload["sync_blocking_s"]
    assert [len(payload["blocking_s"][mode]) for mode in ("sync", "async")] == [2, 2]
    assert sorted(payload["run_s"]) == ["async", "none", "sync"]
    # Both kinds wrote readable checkpoints of the same model, each in its own directory.
    for mode in ("sync", "async"):
        state = (model_dir / mode / "checkpoints" / "checkpoint").read_text()
        assert 'model_checkpoint_path: "ckpt-' in state, state
    assert "blocking per save" in completed.stdout and "end to end" in completed.stdout


def test_stragglers_benchmark_runs_each_way_on_a_cluster_and_reports_the_ratio(tmp_path):
    out = tmp_path / "stragglers.json"
    _run(
        [
            "benchmarks.stragglers",
            "--model=mlp",
            "--train_steps=20",
            "--steps_per_loop=5",
            "--repeats=1",
            f"--json={out}",
        ],
        timeout=480,
    )
    payload = json.loads(out.read_text())
    assert {way: len(runs) for way, runs in payload["runs"].items()} == {"without": 1, "with": 1}
    medians = payload["median_examples_per_second"]
    assert all(figure > 0 for figure in medians.values())
    assert payload["ratio"] == medians["with"] / medians["without"]


def test_the_csv_benchmarks_table_reads_back_as_written(tmp_path):
    """The table the benchmark times is a user's table: read_table gives back its numbers."""
    from benchmarks.csv_read import write_table
    from input.files import read_table

    path = str(tmp_path / "table.csv")
    write_table(path, rows=50, columns=4)
    names, features, labels = read_table(path, "label")
    assert names == ["f0", "f1", "f2"] and features.shape == (50, 3) and labels.dtype == np.int64
    written = np.loadtxt(path, delimiter=",", skiprows=1)
    np.testing.assert_array_equal(features, written[:, :3].astype(np.float32))
    np.testing.assert_array_equal(labels, written[:, 3].astype(np.int64))


@pytest.mark.process
@pytest.mark.timeout(300)
def test_csv_benchmark_times_both_readers_on_one_table(tmp_path):
    out = tmp_path / "csv_read.json"
    _run(["benchmarks.csv_read", "--rows=200", "--columns=4", "--repeats=1", f"--json={out}"], timeout=240)
    payload = json.loads(out.read_text())
    assert (payload["rows"], payload["columns"]) == (200, 4)
    for reader in ("numpy", "python_cells"):
        assert payload[reader]["seconds"] > 0 and payload[reader]["peak_mib"] >= 0, payload
    expected_ratio = payload["python_cells"]["seconds"] / payload["numpy"]["seconds"]
    assert payload["time_ratio"] == pytest.approx(expected_ratio, rel=0.01, abs=0.01)  # From unrounded medians.


@pytest.mark.process
@pytest.mark.timeout(300)
def test_first_step_benchmark_times_each_phase_of_both_runners_in_fresh_processes(tmp_path):
    out = tmp_path / "first_step.json"
    _run(["benchmarks.first_step", "--model=mlp", "--steps=3", "--repeats=1", f"--json={out}"], timeout=240)
    payload = json.loads(out.read_text())
    for runner in ("engine", "fit"):
        phases = payload[runner]
        assert 0 < phases["import_s"] < phases["build_s"], phases  # Seconds from the process's start.
        assert phases["first_s"] > 0 and phases["second_s"] > 0, phases
        assert abs(phases["first_call_s"] - (phases["first_s"] - phases["second_s"])) < 2e-3, phases
    assert payload["engine"]["traces"] == 1  # The training loop is traced once for both calls.
    assert payload["first_ratio"] == round(payload["engine"]["first_s"] / payload["fit"]["first_s"], 2)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_device_check_tiny_prints_one_json_with_every_field(tmp_path):
    from benchmarks.device_check import FIELDS, SECTION_FIELDS

    out = tmp_path / "check.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        [str(REPO / "benchmarks" / "device_check.sh"), "--tiny", f"--json={out}"],
        cwd=tmp_path,  # The script finds the repository itself.
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    printed = json.loads(completed.stdout)  # stdout holds the JSON alone; the logs go to stderr.
    assert printed == json.loads(out.read_text())
    assert set(FIELDS) <= set(printed) and printed["tiny"] is True
    for section in ("bf16_xla", "fp16_xla", "mirrored_bf16_xla"):
        figures = printed[section]
        assert set(SECTION_FIELDS) <= set(figures), figures
        assert figures["error"] is None, figures
        assert figures["engine_images_per_second"] > 0 and figures["raw_images_per_second"] > 0
        assert figures["engine/raw"] > 0 and figures["engine_tflops"] > 0
        assert figures["mfu"] is None  # A CPU has no entry in the table of peaks: omitted, not guessed.
    assert printed["mirrored_bf16_xla"]["replicas"] == 2
    checkpoint = printed["async_checkpoint"]
    assert "blocking_ratio" in checkpoint
    assert checkpoint["blocking_ratio"] is not None or checkpoint["reason"]


def test_device_check_knows_the_peaks_of_common_gpus():
    from benchmarks.device_check import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312.0
    assert peak_tflops("NVIDIA L4", "bfloat16") == 121.0
    assert peak_tflops("NVIDIA L40S", "bfloat16") == 362.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bfloat16") is None
    assert peak_tflops("Some Future GPU", "bfloat16") is None


@pytest.mark.process
@pytest.mark.timeout(400)
def test_sharded_tables_benchmark_measures_each_ps_task_on_a_cluster_of_its_own(tmp_path):
    """Two ways, a cluster each, under a memory limit on the ps tasks: a 1,000,000 x 32 table
    (122 MiB, and as much again for Adagrad's slot) whole on one ps task runs out of the 450 MiB
    each task may grow by (it needs some 630 MiB of address space there), split over two it trains
    (some 340 MiB each): the figures' fields; benchmarks/RESULTS.md has the full run."""
    out = tmp_path / "tables.json"
    _run(
        [
            "benchmarks.sharded_tables",
            "--rows=1000000",
            "--width=32",
            "--num_ps=2",
            "--steps=2",
            "--warmup_steps=1",
            "--ways=one_shard,sharded",
            "--ps_memory_limit_mb=450",
            f"--json={out}",
        ],
        timeout=360,
    )
    payload = json.loads(out.read_text())
    assert payload["ps_memory_limit_mb"] == 450
    failed = payload["ways"]["one_shard"]["failed"]  # TensorFlow's out-of-memory line, or how ps:0 ended.
    assert (
        failed.startswith("OOM when allocating tensor")
        and "/job:ps/replica:0/task:0" in failed
        or (failed.startswith("ps:0 ended"))
    ), failed
    figures = payload["ways"]["sharded"]
    assert len(figures["ps_rss_mb"]) == 2  # One figure a ps task.
    assert figures["bytes_per_step"] > 0 and figures["examples_per_second"] > 0
    assert "largest_ps_memory_sharded_over_one_shard" not in payload  # No ratio with a way that failed.
    assert "bytes_per_step_dense_over_sharded" not in payload  # A ratio only of two ways measured.


@pytest.mark.process
def test_a_ps_task_that_ends_under_its_memory_limit_ends_the_sharded_tables_coordinator_at_once():
    """A ps task that dies (RLIMIT_AS) leaves ParameterServerStrategy's coordinator waiting for it
    forever (the benchmark above hung for its whole timeout once): the benchmark stops the
    coordinator and reports how the task ended."""
    import time

    from benchmarks.sharded_tables import run_coordinator

    def started(code: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    waiting = started("import time; time.sleep(120)")
    live, dying = (
        started("import time; time.sleep(120)"),
        started("import sys; print('Check failed: x', file=sys.stderr); sys.exit(6)"),
    )
    began = time.monotonic()
    try:
        returncode, _, _, ended = run_coordinator(waiting, [dying, live])
    finally:
        for process in (waiting, live, dying):
            process.kill()
            process.wait(timeout=30)
    assert time.monotonic() - began < 30
    assert returncode == -9 and ended == "ps:0 ended (status 6): Check failed: x"
