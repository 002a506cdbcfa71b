"""Loss spikes rolled back: the last good state restored, the batches that led to the spike skipped.

The data put a spike at a known stream position: a batch whose features are huge (a finite loss
far above `max_loss`) or NaN. A run with `on_nonfinite="rollback"` must end with the weights of a
run on the same stream with the skipped batches removed (a filtered dataset): compared bitwise,
since both runs apply the same updates to the same batches in the same order, and a restore
brings back a checkpoint's exact bits.
"""

import json
import logging

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    NUM_FEATURES,
    global_batches,
    loss_fn,
    main_in_process,
    make_arrays,
    make_model,
    make_trainer,
    model_weights,
    one_error_line,
)

import engine
from engine.errors import NonFiniteLossError, UserError
from engine.options import group_options

BATCH = 16
HUGE = 1e6  # Features that make the loss ~1e5, against ~1 for the rest.
MAX_LOSS = 100.0


def spiking_arrays(positions, value=HUGE, batches=40):
    """Arrays of `batches` global batches whose batches at 0-based stream `positions` hold `value`."""
    x, y = make_arrays(BATCH * batches)
    for position in positions:
        x[position * BATCH : (position + 1) * BATCH] = value
    return x, y


# A finite loss above MAX_LOSS is a spike, rolled back.
ROLLBACK_ON_SPIKES = {
    "step": engine.StepOptions(on_nonfinite="rollback"),
    "spikes": engine.SpikeOptions(max_loss=MAX_LOSS),
}


def stream(x, y, skipped=()):
    """The global batches of (x, y) in order, without those at the 0-based positions `skipped`."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    if not skipped:
        return dataset
    left_out = tf.constant(sorted(skipped), tf.int64)
    kept = dataset.enumerate().filter(lambda i, _: tf.logical_not(tf.reduce_any(tf.equal(i, left_out))))
    return kept.map(lambda _, batch: batch)


def trainer(strategy, train_data, model_dir=None, *, optimizer=None, checkpoint_every=2, **kwargs):
    model, default_optimizer = make_model(strategy)
    if optimizer is not None:
        with strategy.scope():
            default_optimizer = optimizer()
    options = {"cadence": engine.Cadence(steps_per_loop=2, checkpoint_every=checkpoint_every), **kwargs}
    return make_trainer(
        strategy,
        model=model,
        optimizer=default_optimizer,
        train_data=train_data,
        global_batch_size=BATCH,
        model_dir=None if model_dir is None else str(model_dir),
        **options,
    )


def weights_after(strategy, train_data, steps, model_dir=None, **kwargs):
    run = trainer(strategy, train_data, model_dir, **kwargs)
    run.train(steps)
    return run, run.model.get_weights()


def assert_same_weights(a, b):
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


def rollback_summaries(model_dir):
    """(step, count) of every `rollbacks` scalar in <model_dir>/train."""
    found = []
    for events in sorted((model_dir / "train").glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            found += [
                (event.step, float(tf.make_ndarray(value.tensor)))
                for value in event.summary.value
                if value.tag == "rollbacks"
            ]
    return found


def spike_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("loss spike")]


@pytest.mark.slow  # Trains twice for seconds: in the full suite.
@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_a_huge_loss_is_rolled_back_to_the_weights_of_the_run_without_its_batches(
    strategy_name, request, tmp_path, caplog
):
    strategy = request.getfixturevalue(strategy_name)
    x, y = spiking_arrays([5])  # Step 6's batch; the loop of steps 5-6 finds it, ckpt-4 is the last good.
    caplog.set_level(logging.WARNING, logger="engine")
    rolled, weights = weights_after(
        strategy,
        stream(x, y),
        12,
        tmp_path / "a",
        **ROLLBACK_ON_SPIKES,
    )
    # Skipped: the batches of steps 5 and 6 (positions 4 and 5), read again from ckpt-4.
    _, expected = weights_after(strategy, stream(x, y, skipped=[4, 5]), 12, tmp_path / "b")
    assert_same_weights(weights, expected)
    assert rolled.rollbacks == 1 and int(rolled.data_position.offset.numpy()) == 2
    [line] = spike_lines(caplog)
    assert "above `max_loss=100.0` at step 6" in line and "ckpt-4 (step 4)" in line, line
    assert "skipping 2 batch(es) (stream positions 4-5); rollback 1 of at most 3" in line, line
    reader = tf.train.load_checkpoint(str(tmp_path / "a" / "checkpoints" / "ckpt-12"))
    assert reader.get_tensor("data_position/offset/.ATTRIBUTES/VARIABLE_VALUE") == 2
    assert reader.get_tensor("data_position/rollbacks/.ATTRIBUTES/VARIABLE_VALUE") == 1
    assert rollback_summaries(tmp_path / "a") == [(6, 1.0)]


def test_a_step_fn_rolls_back_on_its_loss_output(default):
    x, y = spiking_arrays([2])

    def with_step_fn(train_data, **kwargs):
        model, optimizer = make_model(default)
        per_example = loss_fn()

        def replica_step(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(per_example(labels, model(features)), global_batch_size=BATCH)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return {"loss": loss}

        run = make_trainer(
            default,
            model=model,
            optimizer=optimizer,
            train_data=train_data,
            global_batch_size=BATCH,
            loss_fn=None,
            step_fn=replica_step,
            cadence=engine.Cadence(steps_per_loop=2),
            **kwargs,
        )
        run.train(6)
        return run, model.get_weights()

    rolled, weights = with_step_fn(
        stream(x, y),
        **ROLLBACK_ON_SPIKES,
    )
    # Step 3, found by the loop of steps 3-4; no model_dir: back to the start, positions 0-2 skipped.
    _, expected = with_step_fn(stream(x, y, skipped=[0, 1, 2]))
    assert rolled.rollbacks == 1
    assert_same_weights(weights, expected)


def test_a_nan_loss_is_rolled_back_past_n_more_batches_of_a_per_replica_pipeline(default, tmp_path):
    x, y = spiking_arrays([7], value=np.nan)  # Step 8, found by the loop of steps 7-8; ckpt-4 the last good.

    def per_replica(skipped):
        return engine.PerReplicaBatches(fn=lambda input_context: stream(x, y, skipped))

    _, weights = weights_after(
        default,
        per_replica(()),
        12,
        tmp_path / "a",
        checkpoint_every=4,
        step=engine.StepOptions(on_nonfinite="rollback"),
        spikes=engine.SpikeOptions(rollback_skip_batches=3),
    )
    # Steps 5-8 (positions 4-7) and 3 more (8-10).
    _, expected = weights_after(default, per_replica(range(4, 11)), 12, checkpoint_every=4)
    assert_same_weights(weights, expected)


def test_resident_data_skip_as_exactly(mirrored, tmp_path):
    x, y = spiking_arrays([3])

    def resident(x, y):
        """Stream position i is example i: no shuffle, so the skipped batches are known."""
        return engine.ResidentData(
            tensors=(x, y), indices=lambda positions: positions, host_data=global_batches(x, y, BATCH)
        )

    _, weights = weights_after(
        mirrored,
        resident(x, y),
        8,
        tmp_path,
        **ROLLBACK_ON_SPIKES,
    )
    kept = np.concatenate([np.arange(0, 2 * BATCH), np.arange(4 * BATCH, len(x))])  # Positions 2-3 skipped.
    _, expected = weights_after(mirrored, resident(x[kept], y[kept]), 8)
    assert_same_weights(weights, expected)


def test_a_spike_before_the_first_checkpoint_restores_the_initial_state(default, caplog):
    x, y = spiking_arrays([1])
    caplog.set_level(logging.WARNING, logger="engine")
    # No model_dir: nothing on disk, the copy of the state train() took at its start is the last good.
    rolled, weights = weights_after(
        default,
        stream(x, y),
        6,
        **ROLLBACK_ON_SPIKES,
    )
    _, expected = weights_after(default, stream(x, y, skipped=[0, 1]), 6)
    assert_same_weights(weights, expected)
    [line] = spike_lines(caplog)
    assert "at step 2; rolled back to the state at the start of training (step 0)" in line, line
    rolled.close()  # The copy in memory is freed; a later train() call takes a new one.
    assert not tf.io.gfile.exists(rolled.rollback._start_path + ".index")
    rolled.train(8)
    assert rolled.step == 8


def test_max_rollbacks_reached_stops_in_one_line_and_rotation_keeps_the_good_checkpoint(default, tmp_path):
    x, y = spiking_arrays(range(6, 40))  # Every batch from step 7 on spikes.
    run = trainer(
        default,
        stream(x, y),
        tmp_path / "spiking",
        checkpoint=engine.CheckpointOptions(max_checkpoints=2),
        step=engine.StepOptions(on_nonfinite="rollback"),
        spikes=engine.SpikeOptions(max_loss=MAX_LOSS, max_rollbacks=2),
    )
    with pytest.raises(NonFiniteLossError) as raised:
        run.train(20)
    message = str(raised.value)
    assert "\n" not in message
    assert (
        message.startswith("`max_rollbacks=2` reached: loss ") and "above `max_loss=100.0` at step 7" in message
    )
    assert "the latest checkpoint (" in message and "ckpt-6) is kept" in message
    state = tf.train.get_checkpoint_state(str(tmp_path / "spiking" / "checkpoints"))
    assert [p.rsplit("/", 1)[1] for p in state.all_model_checkpoint_paths] == ["ckpt-4", "ckpt-6"]
    weights_after(default, stream(*make_arrays(BATCH * 40)), 6, tmp_path / "clean")
    kept, clean = model_weights(tmp_path / "spiking", 6), model_weights(tmp_path / "clean", 6)
    assert kept.keys() == clean.keys()
    for name in kept:
        np.testing.assert_array_equal(kept[name], clean[name])


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_a_resume_with_a_learning_rate_of_1e12_stops_before_rotation_deletes_the_good_checkpoints(
    default, tmp_path, policy
):
    data = stream(*make_arrays(BATCH * 40))
    trainer(default, data, tmp_path, checkpoint=engine.CheckpointOptions(max_checkpoints=2)).train(6)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir() if p.is_file()}
    resumed = trainer(
        default,
        data,
        tmp_path,
        checkpoint=engine.CheckpointOptions(max_checkpoints=2),
        optimizer=lambda: tf.keras.optimizers.SGD(1e12),
        step=engine.StepOptions(on_nonfinite=policy),
        spikes=engine.SpikeOptions(max_loss=MAX_LOSS),
    )
    stopped = r"above `max_loss=100.0` at step 8(; | after 3 rollback\(s\); )stopped without saving"
    with pytest.raises(NonFiniteLossError, match=stopped):
        resumed.train(20)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir() if p.is_file()}
    assert {name for name in after if name.startswith("ckpt-")} == {
        name for name in before if name.startswith("ckpt-")
    }
    assert all(after[name] == before[name] for name in before if name.startswith("ckpt-"))
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-6")


@pytest.mark.slow  # Trains twice for seconds: in the full suite.
def test_a_resume_after_a_rollback_reads_the_same_batches(default, tmp_path):
    x, y = spiking_arrays([5])
    options = {
        "step": engine.StepOptions(on_nonfinite="rollback"),
        "spikes": engine.SpikeOptions(max_loss=MAX_LOSS),
    }
    _, expected = weights_after(default, stream(x, y), 12, tmp_path / "whole", **options)
    # Stopped right after the rollback (step 6 reached again, ckpt-6 holds the offset), then resumed.
    stopped, _ = weights_after(default, stream(x, y), 6, tmp_path / "stopped", **options)
    assert stopped.rollbacks == 1
    resumed, weights = weights_after(default, stream(x, y), 12, tmp_path / "stopped", **options)
    assert resumed.rollbacks == 1 and int(resumed.data_position.offset.numpy()) == 2
    assert_same_weights(weights, expected)
    # Resumed from a checkpoint taken before the rollback: it happens again, the same.
    weights_after(default, stream(x, y), 4, tmp_path / "early", **options)
    again, weights = weights_after(default, stream(x, y), 12, tmp_path / "early", **options)
    assert again.rollbacks == 1
    assert_same_weights(weights, expected)
    # The offset goes on under another policy: the checkpoint holds it.
    other, _ = weights_after(default, stream(x, y), 12, tmp_path / "stopped")
    assert int(other.data_position.offset.numpy()) == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"on_nonfinite": "rollback", "rollback_skip_batches": -1}, "`rollback_skip_batches=-1` must be >= 0"),
        ({"on_nonfinite": "rollback", "max_rollbacks": 0}, "`max_rollbacks=0` must be at least 1"),
        ({"on_nonfinite": "rollback", "max_rollbacks": 2**31 - 1}, "`max_rollbacks=2147483647` must be at most"),
        ({"max_loss": -1.0}, "`max_loss=-1.0` must be a positive, finite loss"),
        ({"on_nonfinite": "skip", "max_loss": 10.0}, "`max_loss=10.0` stops or rolls back on a spike"),
    ],
)
def test_bad_spike_options_are_refused_naming_them(default, arguments, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        trainer(default, stream(*make_arrays(BATCH * 4)), **group_options(arguments))  # The groups made here.


# ------------------------------------------------------------------ the command line


@pytest.mark.cli
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--on_nonfinite=rollback", "--rollback_skip_batches=-1"], "--rollback_skip_batches=-1 must be >= 0"),
        (["--on_nonfinite=rollback", "--max_rollbacks=0"], "--max_rollbacks=0 must be at least 1"),
        (["--on_nonfinite=rollback", "--max_rollbacks=2147483647"], "--max_rollbacks=2147483647 must be at"),
        (["--on_nonfinite=skip", "--max_loss=10"], "pass --on_nonfinite=stop or --on_nonfinite=rollback"),
        (
            ["--on_nonfinite=rollback", "--strategy=parameter_server"],
            "not supported with --strategy=parameter_server",
        ),
    ],
)
def test_the_command_line_refuses_bad_spike_flags_in_one_line(tmp_path, flags, message):
    result = main_in_process("--dataset=synthetic", "--train_steps=2", f"--model_dir={tmp_path}", *flags)
    assert result.returncode == 2
    assert message in one_error_line(result)


def spiking_npz(path):
    """64 training examples, one of them huge: it spikes once an epoch (4 steps of 16)."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(80, NUM_FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    x[10] = HUGE
    np.savez(path, x_train=x[:64], y_train=y[:64], x_test=x[64:], y_test=y[64:])


@pytest.mark.cli
@pytest.mark.slow
def test_a_command_line_run_rolls_back_and_writes_rollbacks_to_metrics_json(tmp_path):
    spiking_npz(tmp_path / "spike.npz")
    model_dir = tmp_path / "run"
    result = main_in_process(
        f"--dataset={tmp_path / 'spike.npz'}",
        "--model=mlp",
        "--train_steps=8",
        "--global_batch_size=16",
        "--steps_per_loop=2",
        "--checkpoint_every=2",
        "--learning_rate=0.01",
        "--on_nonfinite=rollback",
        f"--max_loss={MAX_LOSS}",
        "--max_rollbacks=10",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    spikes = [line for line in result.stderr.splitlines() if "loss spike: loss" in line]
    assert spikes and all("max_loss=100.0" in line for line in spikes), result.stderr[-3000:]
    record = json.loads((model_dir / "metrics.json").read_text())
    assert record["rollbacks"] == len(spikes) and record["global_step"] == 8


@pytest.mark.cli
@pytest.mark.slow
def test_a_command_line_run_out_of_rollbacks_exits_2_naming_max_rollbacks(tmp_path):
    result = main_in_process(
        "--dataset=synthetic",
        "--train_steps=20",
        "--steps_per_loop=2",
        "--learning_rate=1e12",
        "--on_nonfinite=rollback",
        f"--max_loss={MAX_LOSS}",
        "--max_rollbacks=2",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 2
    line = one_error_line(result)
    # 1e12 from the first step: the loss is NaN or far above --max_loss, at every retry.
    assert (
        line.startswith("engine.main: error: --max_rollbacks=2 reached: ") and "after 2 rollback(s)" in line
    ), line
    assert "stopped without saving" in line, line
