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
