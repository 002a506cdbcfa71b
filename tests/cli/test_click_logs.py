"""--dataset=clicks --model=wide_deep: the offline example of large embedding tables, from the
command line (docs/several-machines.md). Under parameter servers: tests/cluster/test_multi_worker.py."""

import json

import numpy as np
import pytest
from helpers import main_in_process

from input import clicks
from models import wide_deep


def test_click_logs_are_fixed_numbers_then_exact_ids_of_the_models_vocabulary():
    first, second = clicks.load_clicks(), clicks.load_clicks()
    features, labels = (np.asarray(a) for a in first.train_arrays())
    np.testing.assert_array_equal(features, np.asarray(second.train_arrays()[0]))  # Never changes.
    assert features.shape == (clicks.NUM_TRAIN, clicks.NUM_DENSE + clicks.NUM_CATEGORICAL)
    ids = features[:, clicks.NUM_DENSE :]
    assert (ids == np.round(ids)).all() and ids.min() >= 0 and ids.max() < clicks.VOCAB_SIZE
    assert (clicks.NUM_DENSE, clicks.NUM_CATEGORICAL, clicks.VOCAB_SIZE) == (
        wide_deep.NUM_DENSE,
        wide_deep.NUM_IDS,
        wide_deep.VOCAB_SIZE,
    )
    assert set(np.unique(labels)) == {0, 1} and 0.2 < labels.mean() < 0.8
    assert first.num_eval_examples == clicks.NUM_EVAL
    small_ids = np.asarray(clicks.load_clicks(1000).train_arrays()[0])[:, clicks.NUM_DENSE :]  # --vocab_size
    assert small_ids.max() == 999 and small_ids.min() == 0 and (small_ids == np.round(small_ids)).all()


@pytest.mark.cli
@pytest.mark.slow  # Trains 300 steps in this process.
def test_wide_deep_learns_the_ids_of_click_logs_and_the_banner_says_where_each_table_is(tmp_path):
    result = main_in_process(
        "--dataset=clicks",
        "--model=wide_deep",
        "--metrics=auc",
        "--train_steps=300",
        "--steps_per_loop=100",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["eval"]["num_examples"] == clicks.NUM_EVAL
    # The numbers alone rank clicks with an AUC of 0.62 at best (the data's own logits without
    # the ids' effects); above it, the id tables learned.
    assert metrics["eval"]["auc"] > 0.75, metrics["eval"]
    for table in ("deep_ids", "wide_ids"):
        assert f"table '{table}': 100000 x " in result.stderr
    assert "in 4 shard(s): 25000 rows on CPU:0, 25000 rows on CPU:0" in result.stderr


@pytest.mark.cli
def test_ps_shards_sets_the_tables_shards_and_a_model_dir_keeps_its_count_until_told_another(tmp_path):
    """--ps_shards is part of the model: the tables hold that many shards, the model_dir's
    config keeps the count (so its checkpoints restore onto any number of ps tasks), and a
    rerun asking for another count re-cuts the tables on restore and keeps that count."""
    import yaml
    from helpers import one_error_line

    from engine.checkpointing.discovery import latest_checkpoint

    flags = ["--dataset=clicks", "--model=wide_deep", "--train_steps=2", "--steps_per_loop=2", "--eval_every=0"]
    first = main_in_process(*flags, "--ps_shards=3", f"--model_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "table 'deep_ids': 100000 x 16 in 3 shard(s): 33334 rows on CPU:0" in first.stderr
    import tensorflow as tf

    stored = tf.train.list_variables(latest_checkpoint(str(tmp_path / "checkpoints")))
    deep_shards = [
        shape
        for name, shape in stored
        if name.startswith("optimizer/_trainable_variables/") and "SLOT" not in name and shape[1:] == [16]
    ]
    assert sorted(deep_shards) == [[33333, 16], [33333, 16], [33334, 16]], stored  # The checkpoint's too.
    resharded = main_in_process(*flags, "--ps_shards=2", "--train_steps=4", f"--model_dir={tmp_path}")
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    assert "table 'deep_ids': 3 shard(s) in " in resharded.stderr, resharded.stderr[-3000:]
    assert "re-cut into 2 on restore" in resharded.stderr
    assert "table 'deep_ids': 100000 x 16 in 2 shard(s): 50000 rows on CPU:0" in resharded.stderr
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["ps_shards"] == 2
    again = main_in_process(*flags, "--train_steps=6", f"--model_dir={tmp_path}")  # The count it keeps now.
    assert again.returncode == 0 and "in 2 shard(s)" in again.stderr, again.stderr[-3000:]
    assert "re-cut" not in again.stderr
    assert "--ps_shards=0 must be at least 1" in one_error_line(main_in_process(*flags, "--ps_shards=0"))


@pytest.mark.cli
@pytest.mark.parametrize("count", [100_001, 5000])
def test_a_ps_shards_past_the_limit_is_one_line_before_anything_is_built(tmp_path, count):
    """100,001 shards built 200,000 variables (2.6 GB, no line in 180 s); 5,000 never trained in
    180 s: each shard is a gather and an update in every step (engine.cli.run.table_shards)."""
    import time

    from helpers import one_error_line

    model_dir = tmp_path / "run"
    began = time.monotonic()
    result = main_in_process(
        "--dataset=clicks", "--model=wide_deep", f"--ps_shards={count}", f"--model_dir={model_dir}"
    )
    assert one_error_line(result) == (
        f"engine.main: error: --ps_shards={count} is over the limit of 1024 shard variables: each adds a "
        "gather, a gradient and an update to every step (about 90 ms to trace and 1 MiB each, measured); use "
        "--ps_shards=1024 or fewer, about as many as ps tasks"
    )
    assert time.monotonic() - began < 30 and not model_dir.exists()


@pytest.mark.cli
def test_vocab_size_sizes_the_click_ids_and_the_tables_and_is_part_of_the_model(tmp_path):
    """--vocab_size: the data's ids and wide_deep's tables alike; the model_dir keeps it (a rerun
    without it has its tables, another size is refused in one line); elsewhere it is refused."""
    from helpers import one_error_line, snapshot

    from engine.cli.config.settings.sections import MAX_VOCAB_SIZE

    flags = ["--dataset=clicks", "--model=wide_deep", "--train_steps=2", "--steps_per_loop=2", "--eval_every=0"]
    first = main_in_process(*flags, "--vocab_size=1000", "--ps_shards=3", f"--model_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "table 'deep_ids': 1000 x 16 in 3 shard(s): 334 rows on CPU:0" in first.stderr
    assert "table 'wide_ids': 1000 x 1 in 3 shard(s)" in first.stderr
    before = snapshot(tmp_path)
    refused = main_in_process(*flags, "--vocab_size=2000", "--train_steps=4", f"--model_dir={tmp_path}")
    assert "--vocab_size=2000 differs from vocab_size=1000" in one_error_line(refused)
    assert snapshot(tmp_path) == before
    evaluated = main_in_process("--mode=eval", f"--model_dir={tmp_path}")  # Rebuilt at the size it kept.
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["eval"]["num_examples"] == clicks.NUM_EVAL
    assert one_error_line(main_in_process("--model=mlp", "--vocab_size=10")) == (
        "engine.main: error: --vocab_size=10 is for --dataset=clicks and --model=wide_deep; drop it"
    )
    assert "--vocab_size=0 must be at least 1" in one_error_line(main_in_process(*flags, "--vocab_size=0"))
    too_many = one_error_line(main_in_process(*flags, f"--vocab_size={MAX_VOCAB_SIZE + 1}"))
    assert f"use --vocab_size={MAX_VOCAB_SIZE} or fewer" in too_many
    assert MAX_VOCAB_SIZE == clicks.MAX_VOCAB_SIZE
