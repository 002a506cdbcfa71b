"""What a user sees in TensorBoard: a finished CLI run's model_dir served by
the real TensorBoard on 127.0.0.1 and read back through its HTTP data API;
the profiler window; hooks adding nothing to the compiled step.

Covers: engine/hooks/graph.py, engine/hooks/profiler.py, engine/summaries.py.
"""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from helpers import global_batches, main_in_process, make_arrays, make_model, make_trainer

import engine
from engine.hooks import BestCheckpoint, EarlyStopping, ProfileWindow, ReduceLROnPlateau, TrainGraph

TRAIN_STEPS = 12


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One CLI run with every new flag (12 steps, in-process); the tests below read what it left."""
    root = tmp_path_factory.mktemp("tb")
    model_dir, export_dir = root / "run", root / "export"
    result = main_in_process(
        "--model=mlp",
        f"--train_steps={TRAIN_STEPS}",
        "--steps_per_loop=6",
        "--log_every=4",
        "--eval_every=4",
        "--profile_steps=4,8",
        "--lr_schedule=cosine",
        "--learning_rate=0.01",
        "--early_stop_metric=loss",
        "--early_stop_patience=5",
        "--best_checkpoint_metric=accuracy",
        f"--model_dir={model_dir}",
        f"--export_dir={export_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir, result.stderr


@pytest.mark.cli
@pytest.mark.slow
def test_cli_run_logs_profiles_and_keeps_the_best(finished_run):
    model_dir, stderr = finished_run
    progress = [line for line in stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["4/12", "8/12", "12/12"]
    assert all(" examples/s" in line for line in progress)
    # The first loop (at 4) traces: the ETA is shown from the second on, never as `eta=?`.
    assert ["eta=" in line for line in progress] == [False, True, True] and "eta=?" not in stderr
    traces = list((model_dir / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert best["metric"] == "accuracy" and best["step"] in (4, 8, 12)
    for banner_part in (
        "strategy=default",
        "replicas=1",
        "devices=",
        "global_batch=64",
        "per_replica_batch=64",
        "precision=float32",
        "params=",
        f"model_dir={model_dir}",
    ):
        assert banner_part in stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(base: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.process
@pytest.mark.slow
def test_tensorboard_server_shows_train_and_eval_scalars(finished_run):
    model_dir, _ = finished_run
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
            "--reload_interval=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        tags = {}
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                tags = get_json(base, "/data/plugin/scalars/tags")
            except OSError:
                tags = {}
            if "loss" in tags.get("train", {}) and "loss" in tags.get("eval", {}):
                break
            time.sleep(0.5)
        assert {"loss", "accuracy", "learning_rate", "examples_per_second", "steps_per_second"} <= set(
            tags["train"]
        )
        assert {"loss", "accuracy", "num_examples"} <= set(tags["eval"])

        def scalars(run, tag):
            query = urllib.parse.urlencode({"run": run, "tag": tag})
            return {step: value for _, step, value in get_json(base, f"/data/plugin/scalars/scalars?{query}")}

        train_loss, eval_loss = scalars("train", "loss"), scalars("eval", "loss")
        assert sorted(train_loss) == [4, 8, 12] and all(math.isfinite(v) for v in train_loss.values())
        assert sorted(eval_loss) == [4, 8, 12]
        assert scalars("eval", "num_examples")[12] == 297
        rates = scalars("train", "learning_rate")  # cosine from 0.01 to 0 at step 12
        for step, rate in rates.items():
            assert rate == pytest.approx(0.005 * (1 + math.cos(math.pi * step / TRAIN_STEPS)), abs=1e-6)

        graphs = get_json(base, "/data/plugin/graphs/info")
        assert "train_loop" in graphs["train"]["tags"]
        experiment = get_json(base, "/data/plugin/hparams/experiment", {"experimentName": ""})
        names = {info["name"] for info in experiment["hparamInfos"]}
        assert {"lr_schedule", "learning_rate", "global_batch_size", "model"} <= names
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_profiler_window_and_hooks_cost_nothing_in_the_compiled_step(mirrored, tmp_path):
    x, y = make_arrays(32)
    tracing_counts = []
    loops = []
    for hooks in (
        [],
        [
            TrainGraph(),
            ProfileWindow(3, 5),
            EarlyStopping("loss", patience=9),
            BestCheckpoint("loss"),
            ReduceLROnPlateau("loss", patience=9),
            lambda trainer, step, logs: loops.append(step),
        ],
    ):
        model, optimizer = make_model(mirrored)
        trainer = make_trainer(
            mirrored,
            model=model,
            optimizer=optimizer,
            arrays=(x, y),
            eval_data=global_batches(x, y, 16).take(1),
            cadence=engine.Cadence(eval_every=4, steps_per_loop=4, log_every=2),
            callbacks=hooks,
            model_dir=str(tmp_path / str(len(hooks))),
        )
        trainer.train(10)
        tracing_counts.append(
            (
                trainer.train_loop.experimental_get_tracing_count(),
                trainer.eval_loop.experimental_get_tracing_count(),
            )
        )
    assert tracing_counts == [(1, 1), (1, 1)]
    assert loops == [2, 3, 4, 5, 6, 8, 10]  # cut at the window's ends, log_every and eval_every
    traces = list((tmp_path / "6" / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1


def test_bad_profile_steps_are_refused():
    from engine.cli.config.settings import RunConfig

    for value in ("5", "8,4", "a,b", "-1,3"):
        with pytest.raises(engine.UserError, match=f"--profile_steps={value} must be START,END"):
            RunConfig(profile_steps=value).validate()


def test_a_graph_export_failed_by_a_dead_peer_does_not_stop_training(default, tmp_path, monkeypatch, caplog):
    """Under parameter-server training the export asks every task for run metadata; a worker
    killed at that moment made the coordinator crash although training survives the worker."""
    import tensorflow as tf

    def dead_peer(name):
        raise tf.errors.UnavailableError(None, None, "recvmsg:Connection reset by peer")

    monkeypatch.setattr(tf.summary, "trace_export", dead_peer)
    x, y = make_arrays(32)
    model, optimizer = make_model(default)
    trainer = make_trainer(
        default,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        cadence=engine.Cadence(steps_per_loop=4),
        callbacks=[TrainGraph()],
        model_dir=str(tmp_path),
    )
    with caplog.at_level("WARNING"):
        trainer.train(8)
    assert trainer.step == 8
    assert "train loop graph not written to TensorBoard: recvmsg:Connection reset by peer" in caplog.text
