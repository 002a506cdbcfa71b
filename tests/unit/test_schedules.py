"""Learning-rate schedules: Keras schedule objects, continued after a restart,
with the rate the optimizer uses written to the train summaries."""

import keras
import pytest
from helpers import make_arrays, make_model, make_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import engine
from engine.schedules import learning_rate_schedule


def test_schedule_shapes():
    assert learning_rate_schedule("constant", 0.1, 90) == 0.1
    step = learning_rate_schedule("step", 0.1, 90)
    assert [float(step(s)) for s in (0, 29, 30, 60)] == pytest.approx([0.1, 0.1, 0.01, 0.001])
    cosine = learning_rate_schedule("cosine", 0.1, 90)
    assert [float(cosine(s)) for s in (0, 45, 90)] == pytest.approx([0.1, 0.05, 0.0], abs=1e-7)
    warm = learning_rate_schedule("warmup_cosine", 0.1, 100)  # warmup: a tenth of the run
    assert [float(warm(s)) for s in (0, 5, 10, 55, 100)] == pytest.approx([0, 0.05, 0.1, 0.05, 0], abs=1e-7)
    with pytest.raises(engine.UserError, match="unknown `schedule='linear'`; choose one of: constant"):
        learning_rate_schedule("linear", 0.1, 10)
    with pytest.raises(engine.UserError, match="`warmup_steps=10` leaves no steps"):
        learning_rate_schedule("warmup_cosine", 0.1, 10, warmup_steps=10)


def summary_values(log_dir, tag):
    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {
        event.step: float(tensor_util.make_ndarray(event.tensor_proto)) for event in accumulator.Tensors(tag)
    }


def test_learning_rate_in_summaries_follows_the_schedule_across_a_restart(tmp_path):
    strategy = engine.build_strategy("mirrored", cpu_devices=2)
    schedule = learning_rate_schedule("warmup_cosine", 0.5, 18, warmup_steps=6)
    x, y = make_arrays(32)

    def new_trainer():
        model, _ = make_model(strategy)
        with strategy.scope():
            optimizer = keras.optimizers.SGD(schedule)
        return make_trainer(
            strategy,
            model=model,
            optimizer=optimizer,
            arrays=(x, y),
            cadence=engine.Cadence(steps_per_loop=3),
            model_dir=str(tmp_path),
        )

    first = new_trainer()
    first.train(9)
    first.close()
    second = new_trainer()  # optimizer.iterations comes back from the checkpoint
    assert int(second.optimizer.iterations.numpy()) == 9
    second.train(18)
    second.close()
    logged = summary_values(tmp_path / "train", "learning_rate")
    assert sorted(logged) == [3, 6, 9, 12, 15, 18]
    # Logged after each loop: the rate the next step will use.
    for step, rate in logged.items():
        assert rate == pytest.approx(float(schedule(step)), abs=1e-6), step
    assert logged[6] == pytest.approx(0.5)
