"""Wide & deep for click logs (`--dataset=clicks`): numbers and hashed ids in, a logit out.

The input's first `NUM_DENSE` columns are numbers and the rest ids in [0, vocab_size), as
`input/clicks.py` lays them out (`--vocab_size`, `VOCAB_SIZE` by default). The ids are
looked up in two `engine.ShardedEmbedding` tables: a deep one (`ID_WIDTH` per id, into an
MLP with the numbers) and a wide one (one weight per id, summed: the linear model), which
meet in the logits' Dense. Each table is held as `--ps_shards` shards (4 by default;
`engine.layers.default_num_shards`), which a parameter-server cluster spreads over its ps
tasks: a count of the model, not of the cluster, so that a checkpoint restores onto any
number of ps tasks. Built outside the command line (no default set), a table has one shard
per ps task.
"""

from __future__ import annotations

import keras

from engine.layers import ShardedEmbedding

NUM_DENSE = 4
NUM_IDS = 6  # --dataset=clicks's categorical features, after the numbers.
VOCAB_SIZE = 100_000
ID_WIDTH = 16


def build(input_shape: tuple[int, ...], num_classes: int, vocab_size: int = VOCAB_SIZE) -> keras.Model:
    """The model for ids in [0, `vocab_size`) (`--vocab_size`, as the data were hashed)."""
    if len(input_shape) != 1 or input_shape[0] <= NUM_DENSE:  # Images, or numbers without ids.
        raise ValueError(
            f"wide_deep reads rows of {NUM_DENSE} numbers then ids (--dataset=clicks), not examples of "
            f"shape {tuple(input_shape)}"
        )
    inputs = keras.Input(input_shape, name="features")
    numbers = inputs[:, :NUM_DENSE]
    ids = keras.ops.cast(inputs[:, NUM_DENSE:], "int32")
    rows = ShardedEmbedding(vocab_size, ID_WIDTH, name="deep_ids")(ids)
    deep = keras.layers.Concatenate()([keras.layers.Flatten()(rows), numbers])
    for units in (64, 32):
        deep = keras.layers.Dense(units, activation="relu")(deep)
    wide = ShardedEmbedding(vocab_size, 1, name="wide_ids")(ids)
    wide = keras.ops.sum(wide, axis=1)  # The linear model over the ids: one weight each, summed.
    # float32 so logits (and the loss) stay float32 under a mixed policy.
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(
        keras.layers.Concatenate()([deep, wide])
    )
    return keras.Model(inputs, logits, name="wide_deep")
