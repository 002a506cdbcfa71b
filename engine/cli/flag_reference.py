"""`docs/flags.md`, rendered from the one settings source: `RunConfig`'s fields
(`engine/cli/settings.py`), whose default, help and choices also define the flags.

    python -m engine.cli.flag_reference > docs/flags.md

`tests/test_docs.py` fails when docs/flags.md is not what `render()` returns.
Imports no TensorFlow (as `python -m engine.main --help` does not).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.cli.settings import CLUSTER_SETTINGS, DEFAULT_EPOCHS, RunConfig

COMMAND = "python -m engine.cli.flag_reference > docs/flags.md"

# Where the docs say more about a flag (relative to docs/); tests/test_docs.py checks each link.
SEE_ALSO = {
    "strategy": "several-machines.md",
    "tpu": "several-machines.md#on-real-hosts",
    "worker_hosts": "several-machines.md#on-real-hosts",
    "task_type": "several-machines.md#evaluating-beside-training",
    "cluster_resolver": "several-machines.md#slurm-and-kubernetes",
    "startup_timeout": "several-machines.md#restarts-start-up-and-signals",
    "mode": "several-machines.md#evaluating-beside-training",
    "model": "own-model.md",
    "device_data_mb": "research.md#data-kept-on-the-devices",
    "early_stop_metric": "callbacks.md",
    "best_checkpoint_metric": "callbacks.md",
    "reduce_lr_metric": "callbacks.md",
    "model_dir": "fault-tolerance.md",
    "restore_fallback": "fault-tolerance.md",
    "reset_optimizer": "fault-tolerance.md",
    "on_nonfinite": "fault-tolerance.md",
    "export_dir": "export.md",
    "ema_decay": "moving-average.md",
    "profile_steps": "tensorboard.md",
    "histogram_every": "tensorboard.md",
}

HEADER = f"""\
# Flags

<!-- Generated from engine/cli/settings.py (RunConfig) by `{COMMAND}`; do not edit. -->

Every flag of `python -m engine.main`, from `RunConfig` in
[`engine/cli/settings.py`](../engine/cli/settings.py), the one place each setting is defined
(its default, help and choices; `python -m engine.main --help` prints the same
help). The cluster flags (marked *also `engine.server`*) are defined by
`engine/cli/cluster_flags.py` and taken by `python -m engine.server` too; the rest by
`engine/cli/flags.py`. A flag with choices refuses any other value with one line.
`--flagfile=FILE` reads flags from a file, as in absl. What bad input and the
output look like: [The command line](command-line.md).

| flag | default | choices | meaning |
| --- | --- | --- | --- |
"""


def _default(name: str, value: Any) -> str:
    if name == "epochs" and value is None:
        return f"{DEFAULT_EPOCHS:g} (when `--train_steps` is not set)"
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Help text as one Markdown table cell: no pipes, no line breaks, `<x>` shown, not read as HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render() -> str:
    """The whole of docs/flags.md."""
    rows = []
    for field in dataclasses.fields(RunConfig):
        choices = field.metadata["choices"]
        meaning = _cell(field.metadata["help"])
        if field.name in CLUSTER_SETTINGS:
            meaning += " *(also `engine.server`)*"
        if field.name in SEE_ALSO:
            meaning += f" [More]({SEE_ALSO[field.name]})."
        choice_cell = ", ".join(f"`{choice}`" for choice in choices) if choices else ""
        default = _default(field.name, field.default)
        rows.append(f"| `--{field.name}` | {default} | {choice_cell} | {meaning} |\n")
    return HEADER + "".join(rows)


if __name__ == "__main__":
    print(render(), end="")
