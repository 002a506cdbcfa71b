"""--mode and the evaluator: it reads checkpoints another process writes, evaluates
each once at its step, and writes metrics.json only when it may. The evaluators that
wait for checkpoints are real processes, each with a timeout; the trainers beside them,
the single evaluations and the refusal of --mode=eval without a checkpoint run in-process.

Covers: engine/cli/run/assembly.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO, eval_steps, in_background, main_in_process, python_env

FLAGS = [
    "--model=mlp",
    "--dataset=digits",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--global_batch_size=32",
    "--steps_per_loop=10",
    "--eval_every=0",
]


def engine_main(*flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.main", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=timeout,
    )


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_then_eval_modes_on_a_finished_dir(tmp_path):
    # train_and_eval's run on the same settings (compared at the end): a process beside this one.
    both = in_background(engine_main, *FLAGS, "--train_steps=30", f"--model_dir={tmp_path / 'both'}")
    trained = engine_main(*FLAGS, "--train_steps=30", "--mode=train", f"--model_dir={tmp_path}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["eval"] == {}  # --mode=train: no evaluation
    assert not (tmp_path / "eval").exists()
    checkpoint_files = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}

    evaluated = main_in_process(*FLAGS, "--train_steps=30", "--mode=eval", f"--model_dir={tmp_path}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 30 and metrics["eval"]["num_examples"] == 297, metrics
    assert eval_steps(tmp_path) == [30]
    assert "ckpt-30.index" in checkpoint_files
    # The evaluator wrote nothing under checkpoints/: the same files, byte for byte.
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == checkpoint_files

    # The same evaluation as train_and_eval's final one on the same weights.
    both = both.result()
    assert both.returncode == 0, both.stderr[-3000:]
    final = json.loads((tmp_path / "both" / "metrics.json").read_text())["eval"]
    assert final["loss"] == pytest.approx(metrics["eval"]["loss"], rel=1e-6)
    assert final["accuracy"] == metrics["eval"]["accuracy"]


@pytest.mark.cli
def test_eval_without_a_checkpoint_is_a_one_line_error(tmp_path):
    result = main_in_process(*FLAGS, "--mode=eval", f"--model_dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("engine.main: error: --mode=eval: no checkpoint in")
    assert list(tmp_path.iterdir()) == []


class Evaluator:
    """`engine.main --mode=continuous_eval` in the background, output collected live."""

    def __init__(self, *flags: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.main", *flags],
            cwd=REPO,
            text=True,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: list[str] = []
        threading.Thread(
            target=lambda: self.lines.extend(line.rstrip() for line in self.process.stdout), daemon=True
        ).start()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline and self.process.poll() is None, "\n".join(self.lines[-40:])
            time.sleep(0.2)


@pytest.fixture
def evaluators():
    started: list[Evaluator] = []
    yield lambda *flags: started.append(Evaluator(*flags)) or started[-1]
    for evaluator in started:
        if evaluator.process.poll() is None:
            evaluator.process.kill()
        evaluator.process.wait(timeout=30)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(700)
def test_an_evaluator_started_before_training_evaluates_each_checkpoint_once(tmp_path, evaluators):
    evaluator = evaluators(
        *FLAGS,
        "--train_steps=60",
        "--mode=continuous_eval",
        "--eval_timeout=200",
        "--best_checkpoint_metric=loss",
        f"--model_dir={tmp_path}",
    )
    evaluator.wait_for("continuous evaluation of", timeout=240)
    # The trainer's two runs (30 and 60 mlp steps) in this process, the evaluator a process of its own.
    first = main_in_process(*FLAGS, "--train_steps=30", "--mode=train", f"--model_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    evaluator.wait_for("eval at step 30", timeout=240)
    assert evaluator.process.poll() is None  # 30 is not the final step: it waits on
    second = main_in_process(
        *FLAGS, "--train_steps=60", "--mode=train", "--checkpoint_every=10", f"--model_dir={tmp_path}"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert evaluator.process.wait(timeout=240) == 0, "\n".join(evaluator.lines[-40:])
    steps = eval_steps(tmp_path)
    assert steps[0] == 30 and steps[-1] == 60 and len(steps) == len(set(steps)), steps
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 60 and metrics["eval"]["num_examples"] == 297, metrics  # merged at the end
    best = json.loads((tmp_path / "best" / "best.json").read_text())  # kept by the evaluator
    assert best["metric"] == "loss" and best["step"] in steps and best["value"] <= metrics["eval"]["loss"]
    assert (tmp_path / "best" / f"ckpt-{best['step']}.index").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index")) == [  # the trainer's, untouched
        "ckpt-40.index",
        "ckpt-50.index",
        "ckpt-60.index",
    ]


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_continuous_eval_gives_up_after_eval_timeout_and_ends_on_sigterm(tmp_path, evaluators):
    # The evaluator SIGTERM ends is a process (started first: its start-up overlaps the idle one's wait).
    waiting = evaluators(*FLAGS, "--train_steps=60", "--mode=continuous_eval", f"--model_dir={tmp_path / 'w'}")
    idle = main_in_process(  # in this process: the exit status and the line, after a short --eval_timeout
        *FLAGS,
        "--train_steps=60",
        "--mode=continuous_eval",
        "--eval_timeout=1",
        f"--model_dir={tmp_path / 'idle'}",
    )
    assert idle.returncode == 0, idle.stderr[-3000:]
    assert "no new checkpoint for 1s" in idle.stderr
    assert not (tmp_path / "idle" / "metrics.json").exists()

    waiting.wait_for("continuous evaluation of", timeout=240)
    waiting.process.send_signal(signal.SIGTERM)
    assert waiting.process.wait(timeout=20) == 128 + signal.SIGTERM  # like a training run stopped by it


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("deleted", ["data-00000-of-00001", "index"])
def test_a_checkpoint_deleted_while_read_is_skipped_not_fatal(two_checkpoints, tmp_path, monkeypatch, deleted):
    import shutil

    from engine.cli.config.settings import RunConfig
    from engine.cli.run import evaluator as evaluator_lib

    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    rotated = tmp_path / "checkpoints" / "ckpt-10"
    (tmp_path / "checkpoints" / f"ckpt-10.{deleted}").unlink()  # rotation, half done
    config = RunConfig(
        model="mlp",
        dataset="digits",
        optimizer="sgd",
        learning_rate=0.1,
        global_batch_size=32,
        steps_per_loop=10,
        train_steps=20,
        mode="continuous_eval",
        model_dir=str(tmp_path),
    )
    evaluator = evaluator_lib.Evaluator(config)
    # Both checkpoints as the evaluator's poll would find them, the first gone by the time it is read.
    monkeypatch.setattr(
        evaluator, "_new_checkpoints", lambda: iter([str(rotated), str(tmp_path / "checkpoints" / "ckpt-20")])
    )
    result = evaluator.run_continuously()
    assert result["global_step"] == 20 and result["eval"]["num_examples"] == 297, result
    assert eval_steps(tmp_path) == [20]
    assert json.loads((tmp_path / "metrics.json").read_text())["eval"] == result["eval"]
    with pytest.raises(evaluator_lib.UserError, match="ckpt-10 cannot be read"):
        evaluator.evaluate(str(rotated), strict=True)


@pytest.mark.cli
@pytest.mark.parametrize(
    "flags,message",
    [
        (
            dict(mode="serve"),
            "unknown --mode='serve'; choose one of: train, eval, train_and_eval, continuous_eval, predict",
        ),
        (
            dict(mode="train", early_stop_metric="loss"),
            "--mode=train runs no evaluation but --early_stop_metric=loss",
        ),
        (dict(mode="continuous_eval", model_dir=None), "--mode=continuous_eval evaluates the checkpoints of a"),
        (dict(mode="eval", eval_timeout=0), "--eval_timeout=0 must be positive"),
        (dict(startup_timeout=-1), "--startup_timeout=-1 must be >= 0"),
    ],
)
def test_bad_mode_flags_are_one_line_user_errors(tmp_path, flags, message):
    from engine.cli.config.flag_names import errors_in_flag_terms
    from engine.cli.config.settings import RunConfig
    from engine.errors import UserError

    settings = dict(model="mlp", model_dir=str(tmp_path / "m"), strategy="multi_worker_mirrored") | flags
    with pytest.raises(UserError) as error, errors_in_flag_terms():  # As engine.main prints them.
        RunConfig(**settings).validate()
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "m").exists()


def _trained_in_process(model_dir, **settings):
    """An mlp model_dir with a checkpoint every 10 steps, trained in-process (--mode=train)."""
    from engine.cli.config.settings import RunConfig
    from engine.cli.run import job

    config = RunConfig(
        **{**ROTATION_SETTINGS, **settings}, mode="train", checkpoint_every=10, model_dir=str(model_dir)
    )
    config.validate()
    job.run(config)
    return model_dir


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """ckpt-10, ckpt-20 and ckpt-30 of a run to step 30."""
    return _trained_in_process(tmp_path_factory.mktemp("rotation") / "run")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """ckpt-10 and ckpt-20 of a run to step 20 (FLAGS, --train_steps=20 --checkpoint_every=10 --mode=train)."""
    return _trained_in_process(tmp_path_factory.mktemp("deleted") / "run", train_steps=20)


ROTATION_SETTINGS = dict(
    model="mlp",
    dataset="digits",
    optimizer="sgd",
    learning_rate=0.1,
    global_batch_size=32,
    steps_per_loop=10,
    eval_every=0,
    train_steps=30,
)


@pytest.mark.cli
@pytest.mark.parametrize("moment", ["restore", "evaluation", "best-checkpoint save"])
def test_rotation_deleting_a_checkpoint_at_any_moment_of_its_read_never_stops_the_evaluator(
    three_checkpoints, tmp_path, monkeypatch, caplog, moment
):
    import shutil

    import tensorflow as tf

    from engine.cli.config.settings import RunConfig
    from engine.cli.run import evaluator as evaluator_lib

    model_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, model_dir)
    checkpoints = model_dir / "checkpoints"
    config = RunConfig(
        **ROTATION_SETTINGS,
        mode="continuous_eval",
        best_checkpoint_metric="loss",
        model_dir=str(model_dir),
    )
    evaluator = evaluator_lib.Evaluator(config)
    rotated = str(checkpoints / "ckpt-10")

    def rotate():
        for path in checkpoints.glob("ckpt-10.*"):
            path.unlink()

    def deleting_first(function):
        def wrapped(*args, **kwargs):
            if (moment != "restore" or args[0] == rotated) and any(checkpoints.glob("ckpt-10.*")):
                rotate()
            return function(*args, **kwargs)

        return wrapped

    if moment == "restore":
        monkeypatch.setattr(
            evaluator.reader.checkpoint, "read", deleting_first(evaluator.reader.checkpoint.read)
        )
    elif moment == "evaluation":
        monkeypatch.setattr(evaluator.runner, "run", deleting_first(evaluator.runner.run))
    else:
        monkeypatch.setattr(evaluator._best, "on_eval_end", deleting_first(evaluator._best.on_eval_end))
    # The three checkpoints as the evaluator's poll finds them; ckpt-10 goes while it is read.
    paths = [rotated, str(checkpoints / "ckpt-20"), str(checkpoints / "ckpt-30")]
    monkeypatch.setattr(evaluator, "_new_checkpoints", lambda: iter(paths))
    result = evaluator.run_continuously()  # Never raises: the evaluator goes on to the next.
    assert result["global_step"] == 30 and result["eval"]["num_examples"] == 297, result
    assert eval_steps(model_dir)[-2:] == [20, 30]
    if moment == "restore":
        assert eval_steps(model_dir) == [20, 30]
        assert (
            sum(
                "skipped" in record.getMessage() and "ckpt-10" in record.getMessage()
                for record in caplog.records
            )
            == 1
        )
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert sorted(p.name for p in (model_dir / "best").glob("ckpt-*.index")) == [best["checkpoint"] + ".index"]
    assert tf.train.load_checkpoint(str(model_dir / "best" / best["checkpoint"])) is not None


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_evaluator_beside_a_trainer_that_keeps_one_checkpoint_survives_rotation(tmp_path, evaluators):
    """The README's trainer + evaluator split at its worst: every checkpoint the evaluator finds is
    rotated away two steps later, often while it is being read."""
    evaluator = evaluators(
        *FLAGS,
        "--train_steps=120",
        "--mode=continuous_eval",
        "--eval_timeout=120",
        "--best_checkpoint_metric=loss",
        f"--model_dir={tmp_path}",
    )
    evaluator.wait_for("continuous evaluation of", timeout=240)
    trained = engine_main(
        *FLAGS,
        "--train_steps=120",
        "--mode=train",
        "--steps_per_loop=2",
        "--checkpoint_every=2",
        "--max_checkpoints=1",
        f"--model_dir={tmp_path}",
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert evaluator.process.wait(timeout=240) == 0, "\n".join(evaluator.lines[-40:])
    output = "\n".join(evaluator.lines)
    assert "Traceback" not in output, output[-3000:]
    # A checkpoint rotated away mid-read is skipped with one line (it happens a few times a run here).
    unexplained = [line for line in evaluator.lines if "NotFoundError" in line and "skipped" not in line]
    assert not unexplained, unexplained
    steps = eval_steps(tmp_path)
    assert steps and steps[-1] == 120 and len(steps) == len(set(steps)), steps  # The final one, each once.
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] in steps and (tmp_path / "best" / f"ckpt-{best['step']}.index").exists(), best


def _evaluated_by_hand(path: str) -> dict[str, float]:
    """The mlp checkpoint at `path` evaluated on digits' eval split in numpy (the reference):
    its weights read back by a bare `tf.train.Checkpoint`, the forward pass, mean cross-entropy
    and accuracy computed here."""
    import numpy as np
    import tensorflow as tf

    from input.registry import get_data_source
    from models import mlp

    model = mlp.build((28, 28, 1), 10)
    tf.train.Checkpoint(model=model).read(path).expect_partial().assert_existing_objects_matched()
    kernel, bias, out_kernel, out_bias = (w.astype(np.float64) for w in model.get_weights())
    source = get_data_source("digits", image_shape=(28, 28, 1), num_classes=10)
    images, labels = (t.numpy() for t in next(iter(source.eval_dataset(global_batch_size=10_000))))
    logits = np.maximum(images.reshape(len(images), -1) @ kernel + bias, 0) @ out_kernel + out_bias
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return {
        "loss": float(-log_softmax[np.arange(len(labels)), labels].mean()),
        "accuracy": float((logits.argmax(axis=1) == labels).mean()),
        "num_examples": len(labels),
    }


@pytest.mark.cli
def test_continuous_eval_evaluates_every_checkpoint_there_in_order_each_as_by_hand(three_checkpoints, tmp_path):
    """Three checkpoints written before the evaluator looks: all three are evaluated, oldest first
    (the evaluator used to take only the newest), each equal to a numpy evaluation of its weights."""
    import shutil

    from engine.cli.config.settings import RunConfig
    from engine.cli.run import evaluator as evaluator_lib

    model_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, model_dir)
    config = RunConfig(**ROTATION_SETTINGS, mode="continuous_eval", model_dir=str(model_dir))
    result = evaluator_lib.Evaluator(config).run_continuously()
    assert result["global_step"] == 30, result
    assert eval_steps(model_dir) == [10, 20, 30]
    evaluations = json.loads((model_dir / "metrics.json").read_text())["evaluations"]
    evaluated = [e for e in evaluations if e["mode"] == "continuous_eval"]
    assert [e["step"] for e in evaluated] == [10, 20, 30], evaluations
    for evaluation in evaluated:
        expected = _evaluated_by_hand(str(model_dir / "checkpoints" / f"ckpt-{evaluation['step']}"))
        logs = evaluation["eval"]
        assert logs["num_examples"] == expected["num_examples"] == 297
        # float32: the same count of right answers (1/297 apart) to its precision.
        assert logs["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6), evaluation
        assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-5), evaluation


@pytest.mark.cli
@pytest.mark.parametrize("known_by", ["cadence", "look"])
def test_checkpoints_rotation_deleted_before_their_turn_are_named_in_one_line(
    three_checkpoints, tmp_path, monkeypatch, caplog, known_by
):
    """While ckpt-10 is evaluated the trainer writes ckpt-20 and ckpt-30 and rotation deletes
    ckpt-20: the evaluator goes on to ckpt-30 and names ckpt-20 in one warning. "cadence": the
    evaluator never saw ckpt-20 listed, the trainer's config.yaml (checkpoint_every=10) tells;
    "look": it saw it listed at its first look (no config.yaml to tell the cadence)."""
    import shutil

    from engine.checkpointing import discovery
    from engine.cli.config.settings import RunConfig
    from engine.cli.run import evaluator as evaluator_lib

    model_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, model_dir)
    checkpoints = model_dir / "checkpoints"
    later = tmp_path / "later"  # ckpt-20 and ckpt-30 before the trainer "writes" them
    later.mkdir()
    if known_by == "cadence":
        for path in [*checkpoints.glob("ckpt-20.*"), *checkpoints.glob("ckpt-30.*")]:
            path.rename(later / path.name)
        discovery.write_state(str(checkpoints), str(checkpoints / "ckpt-10"), [str(checkpoints / "ckpt-10")])
    else:
        (model_dir / "config.yaml").unlink()
    config = RunConfig(**ROTATION_SETTINGS, mode="continuous_eval", model_dir=str(model_dir))
    evaluator = evaluator_lib.Evaluator(config)
    run = evaluator.runner.run

    def evaluating_while_training_writes():
        logs = run()
        if (checkpoints / "ckpt-20.index").exists() or any(later.iterdir()):  # once: ckpt-10's evaluation
            for path in later.glob("ckpt-30.*"):
                path.rename(checkpoints / path.name)
            for path in checkpoints.glob("ckpt-20.*"):
                path.unlink()
            discovery.write_state(str(checkpoints), str(checkpoints / "ckpt-30"), [str(checkpoints / "ckpt-30")])
            shutil.rmtree(later)
            later.mkdir()
        return logs

    monkeypatch.setattr(evaluator.runner, "run", evaluating_while_training_writes)
    result = evaluator.run_continuously()
    assert result["global_step"] == 30, result
    assert eval_steps(model_dir) == [10, 30]
    named = [r.getMessage() for r in caplog.records if "not evaluated" in r.getMessage()]
    assert len(named) == 1 and "\n" not in named[0], named
    assert named[0].startswith("not evaluated: ckpt-20 (after step 10, before 30): --max_checkpoints"), named


def test_missed_steps_are_those_seen_and_the_trainers_cadence_between_two_evaluations():
    from engine.cli.run.evaluator import missed_steps

    assert missed_steps(100, 300, {50, 100, 150, 300, 350}, 50) == [150, 200, 250]
    assert missed_steps(100, 300, {150, 170}, None) == [150, 170]  # a save off the cadence, seen listed
    assert missed_steps(0, 30, set(), 500) == []  # the first run's final save (train_steps=30)
    assert missed_steps(0, 40, set(), 10) == [10, 20, 30]  # started before training: from step 0
    assert missed_steps(30, 40, {30, 40}, 10) == []
