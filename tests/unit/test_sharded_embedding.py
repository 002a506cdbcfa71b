"""engine.ShardedEmbedding: a table in row shards that trains as keras.layers.Embedding does.

Covers: engine/layers.py, engine/cli/run/table_shards.py, engine/checkpointing/reshard.py.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_CLASSES, id_sequences, make_trainer, small_trainer

import engine
from engine.errors import UserError
from engine.layers import ShardedEmbedding, default_num_shards, shard_rows

VOCAB, WIDTH, LENGTH = 23, 4, 5


def sequences(count: int = 64):
    return id_sequences(count, vocab=VOCAB, length=LENGTH, classes=NUM_CLASSES)


def tagger(strategy, table, seed: int = 1):
    """Ids -> table -> masked mean over the sequence -> classes; the start drawn from `seed`."""
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                table,
                keras.layers.GlobalAveragePooling1D(),  # Averages the unmasked positions only.
                keras.layers.Dense(NUM_CLASSES),
            ]
        )
    rng = np.random.RandomState(seed)
    full_table = rng.normal(0, 0.5, (VOCAB, WIDTH)).astype("float32")
    dense = [rng.normal(0, 0.5, w.shape).astype("float32") for w in model.layers[-1].get_weights()]
    if isinstance(table, engine.ShardedEmbedding):
        table.set_weights(np.split(full_table, np.cumsum(shard_rows(VOCAB, table.num_shards))[:-1]))
    else:
        table.set_weights([full_table])
    model.layers[-1].set_weights(dense)
    return model


def whole_table(table) -> np.ndarray:
    sharded = isinstance(table, engine.ShardedEmbedding)
    return np.concatenate(table.get_weights()) if sharded else table.get_weights()[0]


def test_rows_split_as_embedding_lookup_divides_them():
    assert shard_rows(23, 3) == [8, 8, 7] and shard_rows(4, 4) == [1, 1, 1, 1] and shard_rows(5, 1) == [5]


def test_lookup_and_mask_equal_keras_embedding(default):
    ids = sequences(8)[0]
    sharded = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 3, mask_zero=True))
    plain = tagger(default, keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True))
    np.testing.assert_array_equal(sharded.layers[0](ids).numpy(), plain.layers[0](ids).numpy())
    np.testing.assert_array_equal(
        sharded.layers[0].compute_mask(ids).numpy(), plain.layers[0].compute_mask(ids).numpy()
    )
    np.testing.assert_array_equal(sharded(ids).numpy(), plain(ids).numpy())  # The mask reaches the pooling.
    assert len(sharded.layers[0].shards) == 3 and [s.shape[0] for s in sharded.layers[0].shards] == [8, 8, 7]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_training_equals_keras_embedding(request, strategy_name, optimizer):
    strategy = request.getfixturevalue(strategy_name)
    arrays = sequences()
    tables = {}
    for name, table in (
        ("sharded", engine.ShardedEmbedding(VOCAB, WIDTH, 3, mask_zero=True)),
        ("plain", keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)),
    ):
        model = tagger(strategy, table)
        with strategy.scope():
            chosen = keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.1}})
        make_trainer(
            strategy, arrays=arrays, model=model, optimizer=chosen, cadence=engine.Cadence(steps_per_loop=3)
        ).train(6)
        tables[name] = (whole_table(table), model.layers[-1].get_weights())
    np.testing.assert_allclose(tables["sharded"][0], tables["plain"][0], rtol=0, atol=1e-6)
    for sharded, plain in zip(tables["sharded"][1], tables["plain"][1], strict=True):
        np.testing.assert_allclose(sharded, plain, rtol=0, atol=1e-6)
    # The rows no batch touched keep their start under SGD (a sparse update); every row trained moved.
    start = whole_table(tagger(strategy, keras.layers.Embedding(VOCAB, WIDTH)).layers[0])
    seen = np.unique(arrays[0])
    moved = np.abs(tables["sharded"][0] - start).max(axis=1) > 0
    assert moved[seen[seen > 0]].all()
    if optimizer == "sgd":
        assert not moved[np.setdiff1d(np.arange(VOCAB), seen)].any()


def test_a_saved_model_file_and_a_config_bring_the_layer_back(default, tmp_path):
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 2, mask_zero=True, name="table"))
    ids = sequences(8)[0]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())
    assert isinstance(loaded.get_layer("table"), engine.ShardedEmbedding)
    assert loaded.get_layer("table").num_shards == 2 and loaded.get_layer("table").mask_zero
    clone = keras.Sequential.from_config(model.get_config())
    assert clone.get_layer("table").get_config() == model.get_layer("table").get_config()


def test_a_checkpoint_restores_under_another_strategy(default, mirrored, tmp_path):
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 3))
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    other = tagger(mirrored, engine.ShardedEmbedding(VOCAB, WIDTH, 3), seed=7)
    tf.train.Checkpoint(model=other).read(path).assert_consumed()
    np.testing.assert_array_equal(whole_table(other.layers[0]), whole_table(model.layers[0]))


def test_the_banner_line_says_how_each_table_is_split_and_where(default):
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 3, name="items"))
    assert engine.layers.describe_tables(model) == [
        "table 'items': 23 x 4 in 3 shard(s): 8 rows on CPU:0, 8 rows on CPU:0, 7 rows on CPU:0"
    ]
    assert engine.layers.describe_tables(tagger(default, keras.layers.Embedding(VOCAB, WIDTH))) == []


def test_without_a_parameter_server_one_shard_by_default(default):
    table = engine.ShardedEmbedding(VOCAB, WIDTH)
    tagger(default, table)
    assert table.num_shards == 1 and len(table.shards) == 1


@pytest.mark.parametrize(
    "arguments, words",
    [
        ((0, WIDTH), "input_dim=0"),
        ((VOCAB, 2.5), "output_dim=2.5"),
        ((VOCAB, WIDTH, 24), "num_shards=24) for 23 rows"),
        ((VOCAB, WIDTH, "2"), "num_shards='2'"),
    ],
)
def test_bad_sizes_are_one_line(arguments, words):
    with pytest.raises(engine.UserError, match="ShardedEmbedding") as raised:
        engine.ShardedEmbedding(*arguments)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_a_saved_model_export_serves_what_the_model_computes(default, tmp_path):
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 3, mask_zero=True))
    ids = sequences(8)[0]
    spec = tf.TensorSpec([None, LENGTH], tf.int32)
    loaded = tf.saved_model.load(engine.export.export_saved_model(model, str(tmp_path / "export"), [spec]))
    np.testing.assert_allclose(loaded.serve(tf.constant(ids)).numpy(), model(ids).numpy(), rtol=0, atol=1e-6)


def _state(model, optimizer) -> dict[str, np.ndarray]:
    """The table whole, the dense weights, and each optimizer variable by name with the table's
    slots whole (`items_shard_<i>_momentum` -> `items_momentum`): what a re-cut must keep."""
    state = {"table": whole_table(model.layers[0])}
    state.update({f"dense_{i}": w for i, w in enumerate(model.layers[-1].get_weights())})
    parts: dict[str, dict[int, np.ndarray]] = {}
    others = []  # In the optimizer's order (the dense layer's slots; names differ from model to model).
    for variable in optimizer.variables:
        shard = re.search(r"items_shard_(\d+)_(.+)$", variable.name)  # <model>_items_shard_<i>_<slot>
        if shard:
            parts.setdefault(f"items_{shard.group(2)}", {})[int(shard.group(1))] = variable.numpy()
        elif variable.name in ("iteration", "learning_rate"):
            state[variable.name] = variable.numpy()
        else:
            others.append(variable.numpy())
    state.update({f"optimizer_{index}": value for index, value in enumerate(others)})
    for slot, shards in parts.items():
        state[slot] = np.concatenate([shards[index] for index in sorted(shards)])
    return state


def test_a_checkpoint_restores_into_another_number_of_shards_rows_and_slots_recut(default, tmp_path):
    """3 shards trained 4 steps with Adam, restored into 2 and 5: the table and Adam's m and v
    equal the originals row for row, and one more step trains each bitwise as it trains the original."""
    import shutil

    arrays = sequences()

    def trainer(model_dir, count, seed=1):
        model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, count, name="items"), seed=seed)
        with default.scope():
            optimizer = keras.optimizers.Adam(0.05)
        return small_trainer(model_dir, arrays=arrays, model=model, optimizer=optimizer), model, optimizer

    first, model, optimizer = trainer(tmp_path / "run", 3)
    first.train(4)
    saved = _state(model, optimizer)
    assert set(saved) >= {"table", "items_momentum", "items_velocity", "iteration"}
    for count in (2, 5):
        shutil.copytree(tmp_path / "run", tmp_path / str(count), ignore=shutil.ignore_patterns("*.lock"))
    first.train(5)  # The original goes on one step: the reference (a resumed run is bitwise the same).
    reference = _state(model, optimizer)
    for count in (2, 5):
        resumed, model, optimizer = trainer(tmp_path / str(count), count, seed=7)
        assert [s.shape[0] for s in model.layers[0].shards] == shard_rows(VOCAB, count)
        restored = _state(model, optimizer)
        assert restored.keys() == saved.keys()
        for name, value in saved.items():
            np.testing.assert_array_equal(restored[name], value, err_msg=f"{name} restored into {count} shards")
        resumed.train(5)
        for name, value in _state(model, optimizer).items():
            message = f"{name} after a step in {count} shards"
            np.testing.assert_array_equal(value, reference[name], err_msg=message)  # Bitwise.
    # The evaluator's read-only restore (CheckpointReader) re-cuts alike.
    from engine.checkpointing.checkpointer import CheckpointReader, checkpoint_of

    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 2, name="items"), seed=7)
    with default.scope():
        optimizer = keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    CheckpointReader(checkpoint_of(model, step, {"optimizer": optimizer})).read(
        str(tmp_path / "run" / "checkpoints" / "ckpt-4"), strict=True
    )
    assert int(step.numpy()) == 4
    for name, value in _state(model, optimizer).items():
        np.testing.assert_array_equal(value, saved[name], err_msg=f"{name} read into 2 shards")


def test_a_checkpoint_without_a_table_shard_is_refused_in_one_line(default, tmp_path):
    """A checkpoint that cannot be re-cut (a table's rows differ) is one line, nothing restored."""
    arrays = sequences()
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 3, name="items"))
    small_trainer(tmp_path, arrays=arrays, model=model, optimizer=keras.optimizers.SGD(0.1)).train(2)
    with default.scope():
        other = keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                engine.ShardedEmbedding(VOCAB + 1, WIDTH, 2, name="items"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(NUM_CLASSES),
            ]
        )
    with pytest.raises(engine.UserError, match="rows of table 'items'") as raised:
        small_trainer(tmp_path, arrays=arrays, model=other, optimizer=keras.optimizers.SGD(0.1))
    assert "\n" not in str(raised.value)


def test_an_id_outside_the_table_fails_under_mirrored_as_a_gather_does(mirrored):
    # With replicas each shard gathers for every id, masked: an id no shard holds would read zeros.
    model = tagger(mirrored, engine.ShardedEmbedding(VOCAB, WIDTH, 3))
    for bad in (VOCAB, -1):
        ids = np.full((4, LENGTH), bad, dtype="int32")
        with pytest.raises(tf.errors.InvalidArgumentError, match="ShardedEmbedding"):
            mirrored.run(tf.function(lambda x: model.layers[0](x)), args=(tf.constant(ids),))


def test_a_default_count_shards_a_table_built_without_one_and_an_explicit_count_wins():
    """engine.layers.default_num_shards (the command line's --ps_shards): the count of every table
    built without its own, capped at one shard per row; outside it, one per ps task (1 here)."""

    def built(layer: ShardedEmbedding) -> int:
        layer(tf.constant([[0, 1]]))
        return len(layer.shards)

    with default_num_shards(3):
        assert built(ShardedEmbedding(10, 2)) == 3
        assert built(ShardedEmbedding(10, 2, num_shards=2)) == 2
        assert built(ShardedEmbedding(2, 2)) == 2  # Never more shards than rows.
    assert built(ShardedEmbedding(10, 2)) == 1
    with pytest.raises(UserError, match=r"default_num_shards\(0\): it must be a whole number >= 1 or None"):
        with default_num_shards(0):
            pass


def test_the_banner_line_summarises_a_table_of_many_shards(default):
    model = tagger(default, engine.ShardedEmbedding(VOCAB, WIDTH, 10, name="items"))
    # 23 rows in 10 shards: three of 3 rows, seven of 2; one line however many shards.
    assert engine.layers.describe_tables(model) == [
        "table 'items': 23 x 4 in 10 shards of 2-3 rows: 10 on CPU:0"
    ]


def test_ps_shards_that_a_table_cannot_take_is_one_line_before_its_variables_exist(monkeypatch):
    """The command line's --ps_shards (engine.cli.run.table_shards.ShardBudget) is checked as each
    table is built: more shards than rows, or more shard variables than the limit in all."""
    from engine.cli.run import table_shards

    def build(*tables: ShardedEmbedding, count: int) -> None:
        with default_num_shards(count, table_shards.ShardBudget()):
            for table in tables:
                table(tf.constant([[0, 1]]))

    small = ShardedEmbedding(10, 2, name="small")
    with pytest.raises(UserError) as raised:
        build(small, count=11)
    assert str(raised.value) == (
        "--ps_shards=11 is more than the 10 rows of table 'small': a shard needs at least one row; "
        "use --ps_shards=10 or fewer (or give that table a num_shards of its own)"
    )
    assert not small.built and not small.weights  # Refused before any variable was made.

    monkeypatch.setattr(table_shards, "MAX_SHARD_VARIABLES", 8)
    first, second = ShardedEmbedding(100, 4, name="first"), ShardedEmbedding(100, 4, name="second")
    with pytest.raises(UserError) as raised:
        build(first, second, count=6)
    assert str(raised.value).startswith(
        "--ps_shards=6 makes 12 shard variables in the 2 tables built so far (about 12 MiB with their step), "
        "over the limit of 8: each adds a gather, a gradient and an update to every step"
    )
    assert str(raised.value).endswith("; use --ps_shards=4 or fewer")
    assert len(first.weights) == 6 and not second.weights
    build(
        ShardedEmbedding(100, 4), ShardedEmbedding(10, 4, num_shards=1), count=8
    )  # Its own count: not checked.
