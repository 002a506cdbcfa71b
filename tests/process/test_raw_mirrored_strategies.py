"""A user's own `tf.distribute.MirroredStrategy` objects, several in one process, train (issue 47).

Every MirroredStrategy numbers its collectives from the same start: a second one's all-reduces
paired with the first one's and aborted every later collective of the process ("Shape mismatch in
the collective instance"), whichever ran first (Keras `fit`, the engine). The engine gives each
strategy it meets keys of its own (`engine.strategy.own_collectives`). In a fresh process: the
failure aborted every later collective of the process it happened in.

Covers: engine/strategy.py.
"""

import json
import subprocess
import sys

import pytest
from helpers import COMMAND_START, REPO, python_env

SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import keras, numpy as np, tensorflow as tf
import engine
from helpers import make_arrays, make_trainer

engine.configure_cpu_devices(2)
x, y = make_arrays(64)

def model_in(strategy, hidden):
    with strategy.scope():
        layers = [keras.Input((6,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(3)]
        model = keras.Sequential(layers)
        optimizer = keras.optimizers.SGD(0.5)
    rng = np.random.RandomState(hidden)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model, optimizer

def train(strategy, hidden):
    model, optimizer = model_in(strategy, hidden)
    trainer = make_trainer(
        strategy, model=model, optimizer=optimizer, arrays=(x, y), cadence=engine.Cadence(steps_per_loop=2)
    )
    trainer.train(4)
    return model.get_weights()

raw = lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
fitted = raw()  # Keras fit first, on a raw strategy of its own (another model: other shapes).
model, _ = model_in(fitted, 8)
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
built = engine.build_strategy("mirrored", cpu_devices=2)
runs = {"raw 16": train(raw(), 16), "raw 40": train(raw(), 40), "built 24": train(built, 24)}
one = tf.distribute.get_strategy()  # Each against the same run on one replica (N replicas train as 1).
gaps = {}
for name, weights in runs.items():
    alone = train(one, int(name.split()[1]))
    gaps[name] = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, alone))
print(json.dumps(gaps))
"""


@pytest.mark.process
@pytest.mark.slow
def test_raw_mirrored_strategies_beside_fit_and_build_strategy_each_train_as_one_replica():
    result = subprocess.run(
        [sys.executable, "-c", COMMAND_START + SCRIPT],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gaps = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(gaps) == {"raw 16", "raw 40", "built 24"}
    assert max(gaps.values()) < 1e-5, gaps
