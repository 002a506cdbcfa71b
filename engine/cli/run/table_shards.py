"""`--ps_shards` checked against the tables a model builds, before their variables exist.

Each shard of an `engine.ShardedEmbedding` is a variable of its own, and every training step
holds a gather, a gradient and an optimizer update per shard, each with its tracing time and
memory (figures: benchmarks/RESULTS.md, "Figures behind the code's choices"). So a
count the tables cannot take is one line, with an estimate of what it would cost, before the
table is built: more shards than a table's rows (a shard needs a row), or more shard variables
than `MAX_SHARD_VARIABLES` in all. Whether the tables' memory fits the hosts is the dry run's
to say (`--dry_run`, which counts each shard's part of the step on the workers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import UserError

MAX_SHARD_VARIABLES = 1024  # In all the model's tables: ~90 s of tracing and ~1.1 GiB measured here.
SHARD_STEP_BYTES = 1 << 20  # A shard's part of the step (its gather, gradient and update), measured.
# Bytes per table element: the weights, Adam's two slots, a dense gradient in the worst case.
TABLE_COPIES = 4


def size_text(count: float) -> str:
    """Bytes in B/KiB/MiB/GiB, three significant digits."""
    if count < 1024:
        return f"{count:.0f} B"
    unit = "B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.3g} {unit}"


def estimate_bytes(rows: int, width: int, shards: int, dtype_size: int = 4) -> int:
    """What a table of `rows` x `width` in `shards` shards costs a run: its state and gradients
    (`TABLE_COPIES`), and each shard's part of the traced step (`SHARD_STEP_BYTES`)."""
    return rows * width * dtype_size * TABLE_COPIES + shards * SHARD_STEP_BYTES


@dataclasses.dataclass
class ShardBudget:
    """The check `engine.layers.default_num_shards` runs as each table without its own count is
    built (`check(layer, count)`): a UserError naming `--ps_shards` and the limit it passes. The
    total is of the tables built so far: a builder's tables are known only as it makes them."""

    shards: int = 0
    tables: int = 0
    bytes: int = 0

    def __call__(self, layer: Any, count: int) -> None:
        rows, width = int(layer.input_dim), int(layer.output_dim)
        if count > rows:
            raise UserError(
                f"--ps_shards={count} is more than the {rows} rows of table {layer.name!r}: a shard needs "
                f"at least one row; use --ps_shards={rows} or fewer (or give that table a num_shards of its own)"
            )
        self.tables += 1
        self.shards += count
        self.bytes += estimate_bytes(rows, width, count)
        if self.shards > MAX_SHARD_VARIABLES:
            tables = f"the {self.tables} tables built so far" if self.tables > 1 else f"table {layer.name!r}"
            fewer = max(1, count * MAX_SHARD_VARIABLES // self.shards)
            raise UserError(
                f"--ps_shards={count} makes {self.shards} shard variables in {tables} (about "
                f"{size_text(self.bytes)} with their step), over the limit of {MAX_SHARD_VARIABLES}: each adds "
                "a gather, a gradient and an update to every step (about 90 ms to trace and 1 MiB each, "
                f"measured); use --ps_shards={fewer} or fewer"
            )
