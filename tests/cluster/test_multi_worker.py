"""Real clusters on localhost through `engine.launch`: one process a task, free
ports, each test with a timeout, and a check that no process and no port
survives the run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    NATIVE_START_UP_LINES,
    REPO,
    SMALL,
    free_ports,
    main_in_process,
    model_weights,
    signal_group,
    wait_for_text,
)

from engine.errors import PEER_LOST_EXIT


@pytest.mark.timeout(600)
def test_two_mirrored_workers_equal_one_process_and_resume(tmp_path, launch):
    flags = [*SMALL, "--steps_per_loop=4"]
    first = launch(
        "--num_workers=2",
        "--",
        "--strategy=multi_worker_mirrored",
        *flags,
        "--train_steps=12",
        f"--model_dir={tmp_path / 'mw'}",
    )
    # The one-process run to compare with, in this process (its TensorFlow already imported: a
    # process of its own cost 3.5 CPU-s more) while the cluster starts.
    single = main_in_process("--strategy=default", *flags, "--train_steps=12", f"--model_dir={tmp_path / 'one'}")
    assert first.wait(timeout=240) == 0, first.output[-4000:]
    first.assert_nothing_left()
    digests = re.findall(r"\[worker:(\d)\].*done: step 12.*weights_digest=(\w+)", first.output)
    assert sorted(digests)[0][0] == "0" and len(digests) == 2 and digests[0][1] == digests[1][1], digests
    # What the cluster prints (engine.cli.process.console): worker:0 alone its progress and summary,
    # every worker its done line (above), each line prefixed once.
    worker0 = [line for line in first.lines if line.startswith("[worker:0] ")]
    worker1 = [line for line in first.lines if line.startswith("[worker:1] ")]
    assert [line for line in worker0 if re.search(r"\] step \d+/12 ", line)], first.output[-4000:]
    assert any(line.startswith("[worker:0] summary") for line in worker0), first.output[-4000:]
    assert not [line for line in worker1 if re.search(r"step \d+/12 |strategy=|summary|Saved checkpoint", line)]
    assert not [line for line in first.lines if line.startswith("[worker:1] [worker:1]")]

    assert single.returncode == 0, single.stderr[-3000:]
    multi, single = model_weights(tmp_path / "mw", 12), model_weights(tmp_path / "one", 12)
    assert multi.keys() == single.keys() and multi
    for name in multi:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
    metrics = json.loads((tmp_path / "mw" / "metrics.json").read_text())
    assert metrics["global_step"] == 12 and metrics["eval"]["num_examples"] == 256
    assert not (tmp_path / "mw" / ".workertemp").exists()

    second = launch(
        "--num_workers=2",
        "--",
        "--strategy=multi_worker_mirrored",
        *flags,
        "--log_all_tasks",  # worker:1's banner too: where it resumed from.
        "--train_steps=16",
        f"--model_dir={tmp_path / 'mw'}",
    )
    assert second.wait(timeout=240) == 0, second.output[-4000:]
    for worker in (0, 1):  # Both restore the chief's checkpoint, so they stay in step.
        second.wait_for(rf"\[worker:{worker}\].*steps=12->16", timeout=1)
        second.wait_for(rf"\[worker:{worker}\].*done: step 16", timeout=1)
    assert (tmp_path / "mw" / "checkpoints" / "ckpt-16.index").exists()
    second.assert_nothing_left()


@pytest.mark.timeout(400)
def test_a_dead_mirrored_worker_fails_the_run_and_stops_the_rest(tmp_path, launch):
    run = launch(
        "--num_workers=2",
        "--",
        "--strategy=multi_worker_mirrored",
        *SMALL,
        "--train_steps=100000",
        "--steps_per_loop=10",
        f"--model_dir={tmp_path}",
    )
    run.wait_for(r"\[worker:0\].*step 10/", timeout=240)
    pid = int(run.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=120) == 128 + signal.SIGKILL, run.output[-3000:]
    assert "worker:1 failed with exit status -9; stopping the other tasks" in run.output
    run.assert_nothing_left()


@pytest.mark.timeout(600)
def test_a_dead_workers_peer_fails_within_the_collective_timeout_without_a_launcher(tmp_path, workers):
    """README: a worker that dies makes the others fail instead of hang, at the
    latest after --collective_timeout seconds. No launcher here to stop the survivor."""
    collective_timeout = 60
    hosts = ",".join(f"localhost:{port}" for port in free_ports(2))
    common = [
        "--strategy=multi_worker_mirrored",
        *SMALL,
        "--train_steps=100000",
        "--steps_per_loop=10",
        f"--collective_timeout={collective_timeout}",
        f"--worker_hosts={hosts}",
        "--task_type=worker",
        f"--model_dir={tmp_path / 'run'}",
    ]
    survivor, survivor_log = workers(*common, "--task_index=0")
    doomed, doomed_log = workers(*common, "--task_index=1")
    wait_for_text(survivor_log, r"step 10/", survivor, timeout=400)  # both are training in lockstep
    assert doomed.poll() is None, doomed_log.read_text()[-3000:]
    signal_group(doomed)
    killed = time.monotonic()
    margin = 60  # a loaded machine: the error may need a while to reach the loop and end the process
    try:
        code = survivor.wait(timeout=collective_timeout + margin)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the survivor still runs {collective_timeout + margin} s after its peer died:\n"
            f"{survivor_log.read_text()[-3000:]}"
        ) from None
    print(f"survivor exited {code} {time.monotonic() - killed:.1f} s after its peer's kill -9")
    assert code == PEER_LOST_EXIT, survivor_log.read_text()[-3000:]  # A lost peer: restartable.
    # Its last line names the peer and where its report is: its last completed step and stacks.
    report = tmp_path / "run" / "diagnostics" / "worker-0.txt"
    assert f"its last step and stacks: {report}" in survivor_log.read_text()
    text = report.read_text()
    assert re.search(r"^last completed step: \d+$", text, re.MULTILINE), text[:1000]
    assert re.search(r"^ended: worker:0: worker:1 \(localhost:\d+\) stopped answering", text, re.MULTILINE)


@pytest.mark.timeout(480)
def test_parameter_server_cluster_trains_to_the_step_and_lowers_the_loss(tmp_path, launch):
    """The example of large tables: wide_deep's id tables split over two ps tasks."""
    run = launch(
        "--num_workers=2",
        "--num_ps=2",
        "--",
        "--strategy=parameter_server",
        "--model=wide_deep",
        "--dataset=clicks",
        "--metrics=auc",
        "--global_batch_size=64",
        "--train_steps=240",
        "--steps_per_loop=80",
        "--eval_every=0",
        "--ema_decay=0.9",  # EMA runs under parameter servers; the evaluation uses the averages.
        f"--model_dir={tmp_path}",
    )
    assert run.wait(timeout=400) == 0, run.output[-4000:]
    run.assert_nothing_left()
    # engine.server's ps and worker tasks hold TensorFlow's C++ start-up lines back too.
    assert "[ps:1]" in run.output and "[worker:1]" in run.output and "eval at step 240" in run.output
    assert [line for line in run.lines if any(s in line for s in NATIVE_START_UP_LINES)] == []
    # Each table's 4 shards round-robin over the 2 ps tasks, as the banner says.
    for table, width in (("deep_ids", 16), ("wide_ids", 1)):
        where = ", ".join(f"25000 rows on ps:{shard % 2}" for shard in range(4))
        assert f"table '{table}': 100000 x {width} in 4 shard(s): {where}" in run.output
    losses = [float(loss) for loss in re.findall(r"\[chief:0\].*step \d+/240 +loss=([\d.]+)", run.output)]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.9, losses
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 240 and metrics["eval"]["num_examples"] == 4003
    assert metrics["eval"]["auc"] > 0.7  # The numbers alone reach 0.62 at best: the split tables learned.
    assert (tmp_path / "checkpoints" / "ckpt-240.index").exists()
    assert "TensorFlow gRPC port(s)" in run.output
    # The checkpoint of the 2 ps tasks evaluates on one device (the shards side by side) as the chief did.
    evaluated = main_in_process("--mode=eval", "--strategy=default", f"--model_dir={tmp_path}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    again = json.loads((tmp_path / "metrics.json").read_text())["eval"]
    assert again["num_examples"] == 4003
    for name in ("loss", "auc"):
        assert abs(again[name] - metrics["eval"][name]) < 1e-6, (name, again, metrics["eval"])
    # Predict and export read that checkpoint on one device too, and agree on 16 examples' logits.
    side = tmp_path.parent / f"{tmp_path.name}-side"
    side.mkdir()
    rng = np.random.RandomState(0)
    numbers, ids = rng.normal(0, 1, (16, 4)), rng.randint(0, 100_000, (16, 6))  # As input/clicks.py has them.
    rows = np.concatenate([numbers, ids], axis=1).astype("float32")
    np.savez(side / "clicks.npz", x=rows)
    predicted = main_in_process(
        "--mode=predict",
        "--strategy=default",
        f"--model_dir={tmp_path}",
        f"--predict_input={side / 'clicks.npz'}",
        f"--predict_output={side / 'logits.npy'}",
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    export_dir = side / "export"
    exported = main_in_process("--strategy=default", f"--model_dir={tmp_path}", f"--export_dir={export_dir}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    served = tf.saved_model.load(str(export_dir)).signatures["serving_default"](features=tf.constant(rows))
    logits = np.load(side / "logits.npy")
    assert logits.shape == (16, 1) and np.isfinite(logits).all()
    np.testing.assert_allclose(logits, served["logits"].numpy(), rtol=1e-5, atol=1e-5)
    # --mode=eval under parameter servers again, on another number of ps tasks (one): the same figures.
    on_one_ps = launch(
        "--num_workers=1",
        "--num_ps=1",
        "--",
        "--mode=eval",
        "--strategy=parameter_server",
        f"--model_dir={tmp_path}",
    )
    assert on_one_ps.wait(timeout=300) == 0, on_one_ps.output[-4000:]
    on_one_ps.assert_nothing_left()
    third = json.loads((tmp_path / "metrics.json").read_text())["eval"]
    assert third["num_examples"] == 4003
    for name in ("loss", "auc"):
        assert abs(third[name] - metrics["eval"][name]) < 1e-6, (name, third, metrics["eval"])


@pytest.mark.timeout(600)
def test_parameter_server_survives_a_killed_worker(tmp_path, launch):
    run = launch(
        "--num_workers=2",
        "--num_ps=1",
        "--",
        "--strategy=parameter_server",
        *SMALL,
        "--train_steps=400",
        "--steps_per_loop=20",
        f"--model_dir={tmp_path}",
    )
    run.wait_for(r"\[chief:0\].*step 20/400", timeout=240)
    pid = int(run.wait_for(r"started worker:1 \(pid (\d+)\)", timeout=1).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=300) == 0, run.output_without_grpc_noise[-6000:]
    assert "worker:1 exited with status -9; restarting it" in run.output
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 400
    assert (tmp_path / "checkpoints" / "ckpt-400.index").exists()
    run.assert_nothing_left()


@pytest.mark.timeout(300)
def test_ctrl_c_ends_every_task(tmp_path, launch):
    run = launch(
        "--num_workers=1",
        "--num_ps=1",
        "--",
        "--strategy=parameter_server",
        *SMALL,
        "--train_steps=100000",
        f"--model_dir={tmp_path}",
    )
    run.wait_for(r"\[ps:0\].*serving at", timeout=180)
    run.process.send_signal(signal.SIGINT)  # The launcher alone, unlike a terminal's Ctrl-C.
    assert run.wait(timeout=60) == 130, run.output[-3000:]
    run.assert_nothing_left()


@pytest.mark.timeout(180)
def test_server_without_a_cluster_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, "-m", "engine.server", "--task_type=chief"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 2
    assert "engine.server: error: --task_type=chief / --task_index=None given without a cluster" in result.stderr


@pytest.mark.timeout(600)
def test_a_frozen_parameter_server_ends_the_chief_within_the_heartbeat_bound_in_one_line(tmp_path, launch):
    """A SIGSTOPped ps task keeps its connections open, and the chief's call on its variables (a
    checkpoint save, a step) waited with no line and no bound (180 s); a killed one ended it at once."""
    run = launch(
        "--num_workers=1",
        "--num_ps=1",
        "--",
        "--strategy=parameter_server",
        *SMALL,
        "--train_steps=100000",
        "--steps_per_loop=10",
        "--checkpoint_every=20",
        "--heartbeat_timeout=5",
        f"--model_dir={tmp_path}",
    )
    pid = int(run.wait_for(r"started ps:0 \(pid (\d+)\)", timeout=60).group(1))
    run.wait_for(r"\[chief:0\].*step \d+/100000", timeout=240)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("checkpoints/ckpt-*.index")):
        assert time.monotonic() < deadline, run.output[-3000:]
        time.sleep(0.5)
    kept = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        assert run.wait(timeout=120) == PEER_LOST_EXIT, run.output_without_grpc_noise[-4000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher killed it, frozen
            os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - frozen
    lines = [line for line in run.lines if "stopped answering" in line and line.startswith("[chief:0]")]
    assert len(lines) == 1, run.output_without_grpc_noise[-4000:]
    assert re.search(
        r"engine.main: error: chief:0: ps:0 \(localhost:\d+\) stopped answering \(no answer for 5 s\): frozen, "
        r"partitioned or dead; stopped without saving, the latest checkpoint \(.*ckpt-\d+\) is kept",
        lines[0],
    ), lines[0]
    assert took < 5 + 30, took  # The bound, a probe, and the launcher's stop of the others.
    assert "Traceback" not in run.output
    latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    assert latest is not None and int(latest.rsplit("-", 1)[1]) >= int(kept.rsplit("-", 1)[1])
    tf.train.load_checkpoint(latest)  # whole and readable
    run.assert_nothing_left()
