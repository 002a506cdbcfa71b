"""engine.ShardedEmbedding under ParameterServerStrategy: a table split over the ps tasks
trains as the whole table does in one process, and its checkpoint restores onto another
number of ps tasks, into another number of shards and onto one device. One process per task
(engine.server), as users run it.

Covers: engine/launch/task_server.py, engine/loop/ps_runners.py, engine/trainer/coordinated.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import COMMAND_START, REPO, id_sequences, make_trainer, ps_servers, python_env

import engine

VOCAB, WIDTH, LENGTH, CLASSES = 23, 4, 5, 3

# The coordinator: a tagger whose table is split over the ps tasks, trained with the library's
# parameter-server Trainer; prints where each shard lives and the weights it ends with.
COORDINATOR = r"""
import json
import sys
import numpy as np
import tensorflow as tf
import keras
sys.path[:0] = ["tests", "tests/cluster"]
import engine
from engine.trainer.coordinated import CoordinatedTrainer
from helpers import make_trainer
from test_sharded_tables import sequences, tagger

hosts, model_dir = json.loads(sys.argv[1]), sys.argv[2]
num_shards, steps = json.loads(sys.argv[3]), int(sys.argv[4])
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(hosts), task_type="chief", task_id=0, rpc_layer="grpc"
)
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
table = engine.ShardedEmbedding(23, 4, num_shards, mask_zero=True, name="table")
model = tagger(strategy, table)
with strategy.scope():
    optimizer = keras.optimizers.Adagrad(0.1)
x, y = sequences()

def train_from(input_context, start_step):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16, drop_remainder=True).skip(start_step)

trainer = make_trainer(
    strategy, trainer_class=CoordinatedTrainer, model=model, optimizer=optimizer, train_data=train_from,
    global_batch_size=16, loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
    cadence=engine.Cadence(steps_per_loop=2, checkpoint_every=4), model_dir=model_dir,
)
trainer.train(steps)
print("RESULT " + json.dumps({
    "step": int(trainer.step),
    "placement": table.placement(),
    "tables": engine.layers.describe_tables(model),  # What engine.main's banner says.
    "table": np.concatenate(table.get_weights()).tolist(),
    "dense": [w.tolist() for w in model.layers[-1].get_weights()],
}))
"""


# A tf.Module tagger under the strategy's own variable_partitioner (FixedShardsPartitioner(N)),
# trained by the same parameter-server Trainer; prints its variables' placement and final values.
MODULE_COORDINATOR = r"""
import json
import sys
import numpy as np
import tensorflow as tf
import keras
sys.path[:0] = ["tests", "tests/cluster"]
import engine
from engine.trainer.coordinated import CoordinatedTrainer
from helpers import make_trainer
from test_sharded_tables import ModuleTagger, sequences, tagger

hosts, model_dir = json.loads(sys.argv[1]), sys.argv[2]
num_shards, steps, kind = json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(hosts), task_type="chief", task_id=0, rpc_layer="grpc"
)
partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_shards)
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
with strategy.scope():
    model = ModuleTagger() if kind == "module" else tagger(strategy, keras.layers.Embedding(23, 4))
    optimizer = keras.optimizers.Adagrad(0.1)
x, y = sequences()

def train_from(input_context, start_step):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16, drop_remainder=True).skip(start_step)

trainer = make_trainer(
    strategy, trainer_class=CoordinatedTrainer, model=model, optimizer=optimizer,
    train_data=engine.PerReplicaBatches(from_step=train_from), global_batch_size=16,
    loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
    cadence=engine.Cadence(steps_per_loop=2, checkpoint_every=4), model_dir=model_dir,
)
trainer.train(steps)
print("RESULT " + json.dumps({
    "step": int(trainer.step),
    "table_shards": [v.device for v in model.table.variables],
    "values": [tf.convert_to_tensor(v).numpy().tolist() for v in (model.table, model.kernel, model.bias)],
}))
"""


class ModuleTagger(tf.Module):
    """The tagger as a tf.Module of plain variables: each one a ShardedVariable under a partitioner."""

    def __init__(self):
        super().__init__()
        table, (kernel, bias) = starting_weights()
        self.table, self.kernel, self.bias = tf.Variable(table), tf.Variable(kernel), tf.Variable(bias)

    def __call__(self, ids, training=False):
        rows = tf.nn.embedding_lookup(self.table, ids)  # A ShardedVariable: each id's row on its shard's task.
        return tf.reduce_mean(rows, axis=1) @ self.kernel + self.bias


def sequences(count: int = 64):
    return id_sequences(count, vocab=VOCAB, length=LENGTH, classes=CLASSES)


def starting_weights():
    rng = np.random.RandomState(1)
    table = rng.normal(0, 0.5, (VOCAB, WIDTH)).astype("float32")
    return table, [rng.normal(0, 0.5, (WIDTH, CLASSES)).astype("float32"), np.zeros(CLASSES, "float32")]


def tagger(strategy, table):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                table,
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(CLASSES),
            ]
        )
    full, dense = starting_weights()
    if isinstance(table, engine.ShardedEmbedding):
        table.set_weights(np.split(full, np.cumsum(engine.layers.shard_rows(VOCAB, table.num_shards))[:-1]))
    else:
        table.set_weights([full])
    model.layers[-1].set_weights(dense)
    return model


def coordinate(hosts: dict, model_dir: Path, num_shards: int | None, steps: int, *program: str) -> dict:
    """`program` (COORDINATOR by default) and its further arguments, which must succeed; its RESULT."""
    result = run_coordinator(hosts, model_dir, num_shards, steps, *(program or [COORDINATOR]))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULT ", 1)[1])


def run_coordinator(
    hosts: dict, model_dir: Path, num_shards: int | None, steps: int, program: str, *more: str
) -> subprocess.CompletedProcess:
    arguments = [json.dumps(hosts), str(model_dir), json.dumps(num_shards), str(steps), *more]
    return subprocess.run(
        [sys.executable, "-c", COMMAND_START + program, *arguments],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )


def whole_table_trained_in_one_process(default, steps: int):
    table = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)
    model = tagger(default, table)
    with default.scope():
        optimizer = keras.optimizers.Adagrad(0.1)
    make_trainer(
        default, arrays=sequences(), model=model, optimizer=optimizer, cadence=engine.Cadence(steps_per_loop=2)
    ).train(steps)
    return table.get_weights()[0], model.layers[-1].get_weights()


@pytest.fixture(scope="module")
def hosts():
    """One worker and two ps tasks (engine.server processes) for every test here: each test's
    coordinators run one after another on them, as the runs within a test already do, which
    saves a cluster's three start-ups of TensorFlow (some 7 CPU-s)."""
    with ps_servers(num_workers=1, num_ps=2) as cluster:
        yield cluster


@pytest.mark.timeout(480)
def test_a_table_over_two_ps_tasks_trains_as_one_table_and_restores_onto_one_ps_and_one_device(
    default, hosts, tmp_path
):
    model_dir = tmp_path / "run"
    # num_shards=None: one shard per ps task, each on its own task.
    two_ps = coordinate(hosts, model_dir, None, 8)
    # The same checkpoint onto a cluster of one ps task: both shards there, training goes on.
    one_ps = coordinate({**hosts, "ps": hosts["ps"][:1]}, model_dir, 2, 12)
    # And into 3 shards over the 2 ps tasks: the rows and Adagrad's slots re-cut on restore.
    three_shards = coordinate(hosts, model_dir, 3, 16)
    assert [device.split("/device")[0] for device in two_ps["placement"]] == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    ]
    assert [device.split("/device")[0] for device in one_ps["placement"]] == ["/job:ps/replica:0/task:0"] * 2
    assert (two_ps["step"], one_ps["step"]) == (8, 12)
    assert two_ps["tables"] == ["table 'table': 23 x 4 in 2 shard(s): 12 rows on ps:0, 11 rows on ps:1"]
    assert one_ps["tables"] == ["table 'table': 23 x 4 in 2 shard(s): 12 rows on ps:0, 11 rows on ps:0"]
    # One worker: the split table trains as the whole table does in one process (Adagrad's
    # slots split alike), and goes on from the checkpoint on the other cluster as if never stopped.
    assert three_shards["tables"] == [
        "table 'table': 23 x 4 in 3 shard(s): 8 rows on ps:0, 8 rows on ps:1, 7 rows on ps:0"
    ]
    for result, steps in ((two_ps, 8), (one_ps, 12), (three_shards, 16)):
        table, dense = whole_table_trained_in_one_process(default, steps)
        np.testing.assert_allclose(np.array(result["table"]), table, rtol=0, atol=1e-6)
        for got, expected in zip(result["dense"], dense, strict=True):
            np.testing.assert_allclose(np.array(got), expected, rtol=0, atol=1e-6)
    # The checkpoint of step 16 restores onto one device, as three shards side by side.
    local = engine.ShardedEmbedding(VOCAB, WIDTH, 3, mask_zero=True, name="table")
    model = tagger(default, local)
    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    tf.train.Checkpoint(model=model).read(latest).expect_partial()
    np.testing.assert_array_equal(np.concatenate(local.get_weights()), np.float32(three_shards["table"]))


@pytest.mark.timeout(480)
def test_a_tf_module_under_the_strategys_variable_partitioner_trains_as_unsharded_and_resumes_onto_one_ps(
    default, hosts, tmp_path
):
    """Research code that gives ParameterServerStrategy a variable_partitioner: every variable of
    its tf.Module model becomes a ShardedVariable, and the Trainer trains their shards (it once
    found no trainable variable at all). A checkpoint restores onto another number of ps tasks
    with the same shard count; another shard count is refused in one line, the checkpoint kept."""
    model_dir = tmp_path / "run"
    two_ps = coordinate(hosts, model_dir, 2, 8, MODULE_COORDINATOR, "module")
    three_shards = run_coordinator(hosts, model_dir, 3, 12, MODULE_COORDINATOR, "module")
    one_ps = coordinate({**hosts, "ps": hosts["ps"][:1]}, model_dir, 2, 12, MODULE_COORDINATOR, "module")
    # A Keras model under the same partitioner: refused before its first step, in one line.
    keras_model = run_coordinator(hosts, tmp_path / "keras", 2, 4, MODULE_COORDINATOR, "keras")
    assert [device.split("/device")[0] for device in two_ps["table_shards"]] == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    ]
    assert [device.split("/device")[0] for device in one_ps["table_shards"]] == ["/job:ps/replica:0/task:0"] * 2
    assert three_shards.returncode != 0
    last_line = three_shards.stderr.strip().splitlines()[-1]  # The library raises; research code sees:
    assert last_line.startswith("engine.errors.UserError: checkpoint "), three_shards.stderr[-3000:]
    assert "ckpt-8 does not match this model" in last_line, last_line
    assert keras_model.stderr.strip().splitlines()[-1] == (
        "engine.errors.UserError: Keras variable 'sequential/embedding/embeddings' was split by the strategy's "
        "variable_partitioner, and Keras 3 cannot train a split variable: make the ParameterServerStrategy "
        "without one and build large tables as engine.ShardedEmbedding (the partitioner serves tf.Module models)"
    ), keras_model.stderr[-3000:]
    assert not (tmp_path / "keras").exists()  # Refused before anything was written.
    # One worker: the sharded tf.Module trains as the whole one does in one process, and goes on
    # from the checkpoint on one ps task as if never stopped (the refused run changed nothing).
    for result, steps in ((two_ps, 8), (one_ps, 12)):
        assert result["step"] == steps
        with default.scope():
            model = ModuleTagger()
            optimizer = keras.optimizers.Adagrad(0.1)
        make_trainer(
            default,
            arrays=sequences(),
            model=model,
            optimizer=optimizer,
            cadence=engine.Cadence(steps_per_loop=2),
        ).train(steps)
        for got, expected in zip(result["values"], (model.table, model.kernel, model.bias), strict=True):
            np.testing.assert_allclose(np.array(got), expected.numpy(), rtol=0, atol=1e-6)
