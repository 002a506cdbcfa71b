"""`Trainer.predict`: one output row per example, in the data's order, as `model.predict`
returns it, whatever the replicas and the partial last batch (issue 21's research half)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_FEATURES, global_batches, make_arrays, make_model, make_trainer

import engine


def trained(strategy, tmp_path=None, **options):
    x, y = make_arrays(64)
    model, optimizer = make_model(strategy)
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        arrays=(x, y),
        batch=8,
        cadence=engine.Cadence(steps_per_loop=4),
        model_dir=None if tmp_path is None else str(tmp_path),
        **options,
    )
    trainer.train(8)
    return trainer, model


@pytest.fixture(scope="module")
def trained_on_two_replicas(mirrored):
    """One trained Trainer (and its model) for every size below: its predictions are compared
    with its own model's, so a Trainer each only trained and traced the same loops again."""
    return trained(mirrored)


@pytest.mark.parametrize("num_examples", [37, 1, 8])  # a partial batch split 3/2, one example, one full batch
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_predict_equals_keras_predict_in_order_over_two_replicas(trained_on_two_replicas, num_examples):
    trainer, model = trained_on_two_replicas
    x, y = make_arrays(num_examples, seed=9)
    expected = model.predict(x, batch_size=8, verbose=0)
    for data in (x, (x, y), tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
        predicted = trainer.predict(data)
        assert predicted.shape == (num_examples, expected.shape[1])
        np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-6)
    # Order, not just the multiset of rows: each row is its own example's.
    np.testing.assert_allclose(trainer.predict(x[::-1]), expected[::-1], rtol=1e-6, atol=1e-6)


def test_predict_traces_once_for_full_and_partial_batches(mirrored):
    trainer, _ = trained(mirrored)
    trainer.predict(make_arrays(21, seed=2)[0])
    trainer.predict(make_arrays(13, seed=3)[0])
    assert trainer._predict_runner.loop.experimental_get_tracing_count() == 1


def test_predict_of_a_module_with_dict_outputs(default):
    class TwoHeads(tf.Module):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(4)
            self.body.build((None, NUM_FEATURES))

        def __call__(self, x):
            hidden = self.body(x)
            return {"logits": hidden, "score": tf.reduce_sum(hidden, axis=1)}

    with default.scope():
        model = TwoHeads()
        optimizer = keras.optimizers.SGD(0.1)
    trainer = make_trainer(
        default,
        model=model,
        optimizer=optimizer,
        train_data=global_batches(*make_arrays(16), 8),
        global_batch_size=8,
        step_fn=lambda batch: {"loss": tf.constant(0.0)},
        loss_fn=None,
    )
    x = make_arrays(11)[0]
    predicted = trainer.predict(x)
    assert set(predicted) == {"logits", "score"}
    np.testing.assert_allclose(predicted["logits"], model.body(x).numpy(), rtol=1e-6)
    np.testing.assert_allclose(predicted["score"], model.body(x).numpy().sum(axis=1), rtol=1e-5)


def test_predict_uses_the_moving_average_with_ema_decay(default):
    trainer, model = trained(default, ema_decay=0.9)
    x = make_arrays(10, seed=4)[0]
    with trainer.averaged_weights():
        averaged = model.predict(x, verbose=0)
    training = model.predict(x, verbose=0)
    assert not np.allclose(averaged, training)  # The averages differ from the weights after 8 steps.
    np.testing.assert_allclose(trainer.predict(x), averaged, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0), training)  # The training weights are back.


def test_predict_refuses_what_it_cannot_batch_in_one_line(default):
    trainer, _ = trained(default)
    with pytest.raises(engine.UserError, match="predict\\(\\) takes a tf.data.Dataset") as raised:
        trainer.predict([[0.0] * NUM_FEATURES])
    assert "\n" not in str(raised.value)
    with pytest.raises(engine.UserError, match="no batches"):
        trainer.predict(tf.data.Dataset.from_tensor_slices(make_arrays(4)[0]).batch(2).take(0))


PS_SCRIPT = r"""
import json
import sys
import numpy as np
import tensorflow as tf
import keras
sys.path.insert(0, "tests")
import engine
from engine.trainer.coordinated import CoordinatedTrainer
from helpers import NUM_FEATURES, make_arrays, make_trainer

cluster = tf.train.ClusterSpec(json.loads(sys.argv[1]))
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    cluster, task_type="chief", task_id=0, rpc_layer="grpc"
)
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
with strategy.scope():
    model = keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
x, y = make_arrays(64)

def train_from(input_context, start_step):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8).skip(start_step)

trainer = make_trainer(
    strategy, trainer_class=CoordinatedTrainer, model=model, optimizer=optimizer, train_data=train_from,
    batch=8, cadence=engine.Cadence(steps_per_loop=4),
)
trainer.train(8)
inputs = make_arrays(21, seed=9)[0]
predicted = trainer.predict(inputs)
expected = model(inputs).numpy()  # The weights read from the ps task, on the coordinator.
print("rows", predicted.shape[0], "max_diff", float(np.abs(predicted - expected).max()))
"""


@pytest.mark.slow  # A parameter-server cluster: two workers and a ps task in engine.server processes.
def test_predict_under_parameter_server_runs_on_the_coordinator_in_order(tmp_path):
    import json
    import subprocess
    import sys

    from helpers import COMMAND_START, REPO, ps_servers, python_env

    # One process per task, as a user runs it (an in-process cluster shares one process's
    # thread pools with the coordinator and is not how the engine runs).
    with ps_servers(num_workers=2, num_ps=1) as hosts:
        result = subprocess.run(
            [sys.executable, "-c", COMMAND_START + PS_SCRIPT, json.dumps(hosts)],
            cwd=REPO,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=150,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [line for line in result.stdout.splitlines() if line.startswith("rows")][-1]
    rows, diff = int(line.split()[1]), float(line.split()[3])
    assert rows == 21 and diff < 1e-6, line
