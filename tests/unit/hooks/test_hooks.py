"""Built-in hooks on scripted eval metrics: early stopping, best checkpoint,
reduce-on-plateau, and how each picks up again after a restart.

Covers: engine/cli/run/hooks_from_flags.py, engine/hooks/best_checkpoint.py, engine/hooks/early_stopping.py,
engine/hooks/metric_watch.py, engine/hooks/plateau.py.
"""

import json
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO, global_batches, kill_group, make_arrays, make_model, make_trainer, python_env

import engine
from engine.callbacks import Callback
from engine.hooks import BestCheckpoint, EarlyStopping, ReduceLROnPlateau
from engine.hooks.metric_watch import MetricWatch


class Scripted(keras.metrics.Metric):
    """An eval metric whose n-th evaluation reports values[n] (the last one after that)."""

    def __init__(self, values=(1.0,), name="score", **kwargs):
        super().__init__(name=name, **kwargs)
        self.values = list(values)
        self.evaluations = -1

    def update_state(self, y_true, y_pred, sample_weight=None):
        pass

    def reset_state(self):  # The trainer resets eval metrics once per evaluation.
        self.evaluations += 1

    def result(self):
        return self.values[min(max(self.evaluations, 0), len(self.values) - 1)]

    def get_config(self):
        return {"name": self.name, "values": self.values}


def scripted_trainer(strategy, model_dir, values, hooks, learning_rate=0.5, checkpoint_every=None):
    x, y = make_arrays(32)
    model, optimizer = make_model(strategy)
    optimizer.learning_rate = learning_rate
    return make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        eval_data=global_batches(x, y, 16).take(1),
        metrics=[Scripted(values)],
        cadence=engine.Cadence(eval_every=2, steps_per_loop=2, checkpoint_every=checkpoint_every),
        model_dir=str(model_dir),
        callbacks=hooks,
    )


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_early_stopping_stops_at_the_expected_step_and_stays_stopped(mirrored, tmp_path):
    # Evaluations at steps 2, 4, 6, 8, 10: best 0.8 at step 4, then three without improvement.
    values = [1.0, 0.8, 0.9, 0.85, 0.95, 0.1]
    trainer = scripted_trainer(mirrored, tmp_path, values, [EarlyStopping("score", patience=3, mode="min")])
    trainer.train(100)
    assert trainer.step == 10
    assert trainer.checkpoint_manager.latest_checkpoint.endswith("ckpt-10")
    history = json.loads((tmp_path / "hooks" / "early_stopping.json").read_text())["history"]
    assert history == [[2, 1.0], [4, 0.8], [6, 0.9], [8, 0.85], [10, 0.95]]

    again = scripted_trainer(mirrored, tmp_path, [0.1], [EarlyStopping("score", patience=3, mode="min")])
    again.train(100)  # The restored run had already stopped.
    assert again.step == 10

    patient = scripted_trainer(mirrored, tmp_path, [0.1], [EarlyStopping("score", patience=5, mode="min")])
    patient.train(14)  # A larger patience continues, and the new best resets the count.
    assert patient.step == 14


@pytest.mark.slow
def test_early_stopping_ignores_evaluations_after_the_restored_checkpoint(mirrored, tmp_path):
    hook = EarlyStopping("score", patience=2, mode="max")
    trainer = scripted_trainer(mirrored, tmp_path, [0.5, 0.4], [hook], checkpoint_every=2)
    trainer.train(4)  # evaluations: 0.5 at 2 (best), 0.4 at 4 (wait 1)
    state = tmp_path / "hooks" / "early_stopping.json"
    history = json.loads(state.read_text())
    history["history"].append([6, 0.3])  # An evaluation after the last checkpoint (a crash).
    state.write_text(json.dumps(history))
    resumed = scripted_trainer(mirrored, tmp_path, [0.45], [EarlyStopping("score", patience=2, mode="max")])
    resumed.train(6)  # Step 6 is evaluated again: wait 2, stop; the stale 0.3 is not counted twice.
    assert resumed.step == 6 and resumed.stop_training
    assert json.loads(state.read_text())["history"] == [[2, 0.5], [4, 0.4], [6, 0.45]]


class WeightsAt(Callback):
    def __init__(self):
        self.weights = {}

    def on_eval_end(self, trainer, step, logs):
        self.weights[step] = [w.copy() for w in trainer.model.get_weights()]


@pytest.mark.slow
def test_best_checkpoint_keeps_the_best_step_across_a_restart(mirrored, tmp_path):
    recorder = WeightsAt()
    trainer = scripted_trainer(
        mirrored, tmp_path, [0.5, 0.7, 0.6, 0.9, 0.8], [BestCheckpoint("score", mode="max"), recorder]
    )
    trainer.train(10)
    best = tmp_path / "best"
    assert json.loads((best / "best.json").read_text()) == {
        "metric": "score",
        "mode": "max",
        "value": 0.9,
        "step": 8,
        "checkpoint": "ckpt-8",
    }
    assert sorted(p.name for p in best.glob("ckpt-*.index")) == ["ckpt-8.index"]

    model, optimizer = make_model(mirrored, seed=7)
    with mirrored.scope():
        optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(str(best / "ckpt-8")).expect_partial()
    for a, b in zip(recorder.weights[8], model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)

    hook = BestCheckpoint("score", mode="max")
    resumed = scripted_trainer(mirrored, tmp_path, [0.85, 0.88, 0.95], [hook])
    resumed.train(14)  # 0.85 at 12 is not better than the restored best 0.9 at step 8.
    assert (hook.best, hook.best_step) == (0.9, 8)
    assert json.loads((best / "best.json").read_text())["step"] == 8
    resumed.train(16)  # 0.95 at 16 is.
    assert (hook.best, hook.best_step) == (0.95, 16)
    assert sorted(p.name for p in best.glob("ckpt-*.index")) == ["ckpt-16.index"]


def learning_rate(trainer):
    return float(tf.convert_to_tensor(trainer.optimizer.learning_rate))


@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_plateau_reduces_the_rate_and_a_restart_keeps_rate_and_patience(mirrored, tmp_path):
    plateau = dict(patience=2, factor=0.5, mode="min")
    trainer = scripted_trainer(mirrored, tmp_path, [1.0], [ReduceLROnPlateau("score", **plateau)])
    trainer.train(10)  # evaluations 2 (best), 4, 6 -> 0.25, 8, 10 -> 0.125
    assert learning_rate(trainer) == pytest.approx(0.125)
    reader = tf.train.load_checkpoint(str(tmp_path / "checkpoints"))
    assert reader.get_tensor("optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE") == pytest.approx(0.125)

    resumed = scripted_trainer(mirrored, tmp_path, [1.0], [ReduceLROnPlateau("score", **plateau)])
    assert learning_rate(resumed) == pytest.approx(0.125)  # Not the 0.5 it was created with.
    resumed.train(14)  # The patience count continues: 12 waits 1, 14 waits 2 -> 0.0625.
    assert learning_rate(resumed) == pytest.approx(0.0625)

    without = scripted_trainer(mirrored, tmp_path, [1.0], [], learning_rate=0.3)
    assert learning_rate(without) == pytest.approx(0.3)  # Without the hook, the new rate wins.


def test_plateau_refuses_a_scheduled_learning_rate(mirrored, tmp_path):
    trainer = scripted_trainer(mirrored, tmp_path, [1.0], [ReduceLROnPlateau("score")])
    trainer.optimizer._learning_rate = keras.optimizers.schedules.CosineDecay(0.1, 10)
    with pytest.raises(engine.UserError, match="give the optimizer a float `learning_rate`"):
        trainer.train(2)


def test_a_missing_metric_names_the_reported_ones(default, tmp_path):
    trainer = scripted_trainer(default, tmp_path, [1.0], [EarlyStopping("acuracy", patience=1)])
    with pytest.raises(
        engine.UserError, match="'acuracy' is not reported; choose one of: loss, num_examples, score"
    ):
        trainer.train(2)


def test_a_nan_or_inf_evaluation_is_never_the_best(caplog):
    for mode in ("min", "max"):
        watch = MetricWatch("loss", mode)
        assert not watch.improves(float("nan"), None) and not watch.improves(float("inf"), None)
        assert not watch.improves(float("-inf"), 1.0) and not watch.improves(float("nan"), 1.0)
        assert not watch.update(float("nan")) and watch.best is None and watch.wait == 1
        assert watch.update(0.5) and watch.best == 0.5  # The next finite value is the first best.
    hook = BestCheckpoint("loss")  # A NaN eval loss once became best/ckpt-N, with "value": NaN in best.json.
    hook.on_eval_end(trainer=None, step=4, logs={"loss": float("nan")})  # Touches no trainer, writes nothing.
    assert (hook.best, hook.best_step) == (None, None)
    assert "eval loss=nan at step 4 is not a number to keep a best checkpoint by" in caplog.text


def test_a_best_json_whose_value_is_not_finite_is_refused_in_one_line_and_left_alone(default, tmp_path):
    """A best.json from someone else holding -Infinity (by a max metric) was taken, and no
    later evaluation could ever beat it: refused like a damaged record, nothing changed. Each
    value in the one model_dir trained once."""
    scripted_trainer(default, tmp_path, [0.5], [BestCheckpoint("score", mode="max")]).train(2)
    best = tmp_path / "best"
    written = (best / "best.json").read_text()
    for value in ("-Infinity", "Infinity", "NaN"):
        (best / "best.json").write_text(written.replace('"value": 0.5', f'"value": {value}'))
        before = {p.name: p.read_bytes() for p in best.iterdir() if p.is_file()}
        assert f'"value": {value}' in before["best.json"].decode()
        hook = BestCheckpoint("score", mode="max")
        with pytest.raises(engine.UserError) as raised:
            hook.restore_state(scripted_trainer(default, tmp_path, [0.9], [hook]))
        message = str(raised.value)
        assert "\n" not in message and f"{best / 'best.json'} is damaged: its value" in message, message
        assert "not a finite number" in message, message
        assert {p.name: p.read_bytes() for p in best.iterdir() if p.is_file()} == before, value


def test_early_stopping_modes():
    with pytest.raises(engine.UserError, match="mode 'best'"):
        EarlyStopping("loss", patience=3, mode="best")
    assert EarlyStopping("val_accuracy", patience=1).watch.mode == "max"
    assert EarlyStopping("loss", patience=1).watch.mode == "min"


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_real_workers_take_the_same_early_stopping_decision(tmp_path):
    """Two multi_worker_mirrored processes: each evaluates its shard, the metrics
    are all-reduced, so both stop at the same step (a worker that stopped alone
    would leave its peer in a collective until --collective_timeout)."""
    log = tmp_path / "launch.log"
    flags = [
        "--strategy=multi_worker_mirrored",
        "--model=mlp",
        "--dataset=synthetic",
        "--optimizer=sgd",
        "--learning_rate=0.5",
        "--global_batch_size=32",
        "--steps_per_loop=5",
        "--eval_every=5",
        "--train_steps=2000",
        "--early_stop_metric=loss",
        "--early_stop_patience=2",
        "--collective_timeout=60",
        "--log_all_tasks",  # worker:1's early-stopping line too, to compare.
        f"--model_dir={tmp_path / 'run'}",
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.launch", "--num_workers=2", "--", *flags],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
            process_group=0,
            env=python_env(),
        )
    try:
        code = process.wait(timeout=540)
    finally:
        kill_group(process)  # the launcher and both workers, whatever their state
    text = log.read_text()
    assert code == 0, text[-4000:]
    stops = dict(re.findall(r"\[(worker:\d)\].*early stopping at step (\d+)", text))
    assert set(stops) == {"worker:0", "worker:1"}, text[-4000:]
    assert stops["worker:0"] == stops["worker:1"], stops
    assert int(stops["worker:0"]) < 2000
    done = dict(re.findall(r"\[(worker:\d)\].*done: step (\d+)", text))
    assert done == stops, (done, stops)


def test_flags_build_the_hooks_and_refuse_bad_combinations():
    from engine.cli.config.settings import RunConfig
    from engine.cli.run.hooks_from_flags import hooks_from_config

    config = RunConfig(
        early_stop_metric="accuracy",
        best_checkpoint_metric="loss",
        reduce_lr_metric="loss",
        reduce_lr_factor=0.2,
    )
    config.validate()
    hooks = hooks_from_config(config.decisions, config.summaries)
    assert [type(h).__name__ for h in hooks] == [
        "TrainGraph",
        "BestCheckpoint",
        "ReduceLROnPlateau",
        "EarlyStopping",
    ]
    assert hooks[-1].watch.mode == "max" and hooks[1].watch.mode == "min"
    bad = [
        # An unknown metric name is refused once the task says what it reports: tests/cli/test_your_problem.py.
        (dict(reduce_lr_metric="loss", lr_schedule="cosine"), "cannot be combined with --lr_schedule=cosine"),
        (dict(early_stop_metric="loss", eval_every=0), "set --eval_every to a positive"),
        (dict(reduce_lr_factor=1.5), "--reduce_lr_factor=1.5 must be between 0 and 1"),
        (dict(lr_schedule="linear"), "unknown --lr_schedule='linear'"),
    ]
    for settings, message in bad:
        with pytest.raises(engine.UserError, match=message.replace("(", r"\(")):
            RunConfig(**settings).validate()


def best_pair(best) -> tuple[str, float]:
    """(the checkpoint, the value) best.json records, after checking that best/ holds that
    checkpoint alone, readable, and that its state file names it."""
    from engine.checkpointing import discovery

    record = json.loads((best / "best.json").read_text())
    assert sorted(p.name for p in best.glob("ckpt-*.index")) == [record["checkpoint"] + ".index"]
    assert discovery.read_problem(str(best / record["checkpoint"])) is None
    state = tf.train.get_checkpoint_state(str(best))
    assert state is not None and state.model_checkpoint_path.endswith("/" + record["checkpoint"])
    return record["checkpoint"], record["value"]


class Crash(BaseException):
    """Stands for kill -9: nothing after it runs, no handler catches it."""


@pytest.mark.parametrize("when", ["before", "after"])
def test_best_checkpoint_and_best_json_agree_after_a_crash_around_the_record(
    default, tmp_path, monkeypatch, when
):
    from engine import model_dir as model_dir_lib

    trainer = scripted_trainer(default, tmp_path, [0.5, 0.7], [BestCheckpoint("score", mode="max")])
    trainer.train(2)  # 0.5 at step 2: the old pair.
    write_json = model_dir_lib.write_json

    def crashing_write_json(path, payload):
        if str(path).endswith("best.json"):
            if when == "after":
                write_json(path, payload)
            raise Crash
        write_json(path, payload)

    monkeypatch.setattr(model_dir_lib, "write_json", crashing_write_json)
    with pytest.raises(Crash):
        trainer.train(4)  # 0.7 at step 4: a new best, cut short.
    monkeypatch.setattr(model_dir_lib, "write_json", write_json)
    hook = BestCheckpoint("score", mode="max")
    hook.restore_state(scripted_trainer(default, tmp_path, [0.6], [hook]))  # What a rerun does first.
    expected = ("ckpt-2", 0.5) if when == "before" else ("ckpt-4", 0.7)
    assert best_pair(tmp_path / "best") == expected
    assert (hook.best_step, hook.best) == (int(expected[0][5:]), expected[1])


def test_a_best_checkpoint_save_that_fails_leaves_no_partial_folder(default, tmp_path, monkeypatch):
    trainer = scripted_trainer(default, tmp_path, [0.5, 0.7], [BestCheckpoint("score", mode="max")])
    trainer.train(2)  # 0.5 at step 2: the best so far.

    def disk_full_write(self, prefix, options=None):
        partial = f"{prefix}_temp"  # What TensorFlow's write leaves when the disk fills.
        tf.io.gfile.makedirs(partial)
        with open(f"{partial}/part-00000-of-00001.data-00000-of-00001.tempstate7", "wb") as handle:
            handle.write(b"half")
        raise tf.errors.ResourceExhaustedError(None, None, f"{partial}/part-00000; No space left on device")

    monkeypatch.setattr(tf.train.Checkpoint, "write", disk_full_write)
    with pytest.raises(tf.errors.ResourceExhaustedError):
        trainer.train(4)  # 0.7 at step 4: a new best, whose save fails.
    assert not (tmp_path / "best" / "ckpt-4_temp").exists()
    assert best_pair(tmp_path / "best") == ("ckpt-2", 0.5)


def _older_versions_mismatch(model_dir, *, rolling_kept: bool):
    """What an older version left when killed between writing best.json (naming ckpt-4)
    and saving ckpt-4 into best/: best/ still holds ckpt-2."""
    best = model_dir / "best"
    record = json.loads((best / "best.json").read_text())
    (best / "best.json").write_text(json.dumps({**record, "value": 0.7, "step": 4, "checkpoint": "ckpt-4"}))
    if not rolling_kept:
        for path in (model_dir / "checkpoints").glob("ckpt-4.*"):
            path.unlink()
        rolling = str(model_dir / "checkpoints")
        tf.compat.v1.train.update_checkpoint_state(rolling, "ckpt-2", all_model_checkpoint_paths=["ckpt-2"])


def test_a_best_json_naming_a_checkpoint_best_does_not_hold_is_repaired_from_the_rolling_one(
    default, tmp_path, caplog
):
    trainer = scripted_trainer(
        default, tmp_path, [0.7, 0.5], [BestCheckpoint("score", mode="max")], checkpoint_every=2
    )
    trainer.train(4)  # best ckpt-2 (0.7); rolling ckpt-2, ckpt-4
    rolling = (tmp_path / "checkpoints" / "ckpt-4.index").read_bytes()
    _older_versions_mismatch(tmp_path, rolling_kept=True)
    hook = BestCheckpoint("score", mode="max")
    hook.restore_state(scripted_trainer(default, tmp_path, [0.1], [hook]))
    assert best_pair(tmp_path / "best") == ("ckpt-4", 0.7)
    assert (tmp_path / "best" / "ckpt-4.index").read_bytes() == rolling
    assert "copied it from" in caplog.text


def test_a_best_json_naming_a_checkpoint_gone_everywhere_is_dropped_and_re_derived(default, tmp_path, caplog):
    trainer = scripted_trainer(
        default, tmp_path, [0.7, 0.5], [BestCheckpoint("score", mode="max")], checkpoint_every=2
    )
    trainer.train(4)
    _older_versions_mismatch(tmp_path, rolling_kept=False)
    hook = BestCheckpoint("score", mode="max")
    resumed = scripted_trainer(default, tmp_path, [0.3], [hook])
    hook.restore_state(resumed)
    assert hook.best is None  # The lie is not kept ...
    assert "the next evaluation sets a new best" in caplog.text
    aside = list((tmp_path / "best" / "superseded").glob("*/ckpt-2.index"))
    assert len(aside) == 1  # ... and the checkpoint of unknown value is moved, not deleted.
    resumed.train(4)  # ... and the next evaluation (0.3 at step 4, resumed from 2) is the best.
    assert best_pair(tmp_path / "best") == ("ckpt-4", 0.3)
