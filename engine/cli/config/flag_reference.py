"""`docs/flags.md`, rendered from the one settings source: `RunConfig`'s fields
(`engine/cli/config/settings/`), whose default, help and choices also define the flags.

    python -m engine.cli.config.flag_reference > docs/flags.md

`tests/unit/test_docs.py` fails when docs/flags.md is not what `render()` returns.
Imports no TensorFlow (as `python -m engine.main --help` does not).
"""

from __future__ import annotations

from typing import Any

from engine.cli.config.settings import CLUSTER_SETTINGS, DEFAULT_EPOCHS, SECTIONS, field_default
from engine.cli.config.usage import grouped_settings

COMMAND = "python -m engine.cli.config.flag_reference > docs/flags.md"

# Where the docs say more about a flag (relative to docs/); tests/unit/test_docs.py checks each link.
SEE_ALSO = {
    "strategy": "several-machines.md",
    "tpu": "several-machines.md#on-real-hosts",
    "worker_hosts": "several-machines.md#on-real-hosts",
    "task_type": "several-machines.md#evaluating-beside-training",
    "cluster_resolver": "several-machines.md#slurm-and-kubernetes",
    "startup_timeout": "several-machines.md#restarts-start-up-and-signals",
    "data_service": "several-machines.md#when-the-input-is-the-bottleneck",
    "mode": "several-machines.md#evaluating-beside-training",
    "model": "own-model.md",
    "device_data_mb": "research.md#data-kept-on-the-devices",
    "early_stop_metric": "callbacks.md",
    "best_checkpoint_metric": "callbacks.md",
    "reduce_lr_metric": "callbacks.md",
    "model_dir": "fault-tolerance.md",
    "restore_fallback": "fault-tolerance.md",
    "reset_optimizer": "fault-tolerance.md",
    "async_checkpoint": "fault-tolerance.md#asynchronous-checkpoints",
    "on_nonfinite": "fault-tolerance.md",
    "export_dir": "export.md",
    "ema_decay": "moving-average.md",
    "profile_steps": "tensorboard.md",
    "histogram_every": "tensorboard.md",
}

HEADER = f"""\
# Flags

<!-- Generated from engine/cli/config/settings/ (RunConfig) by `{COMMAND}`; do not edit. -->

Every flag of `python -m engine.main`, from `RunConfig` in
[`engine/cli/config/settings/`](../engine/cli/config/settings/), the one place each setting is defined
(its default, help and choices; `python -m engine.main --help` prints the same
help). The cluster flags (marked *also `engine.server`*) are defined by
`engine/cli/config/cluster_flags.py` and taken by `python -m engine.server` too; the rest by
`engine/cli/config/flags.py`. A flag with choices refuses any other value with one line.
`--flagfile=FILE` reads flags from a file, as in absl; `--config_file=FILE` reads
settings from a YAML or JSON file, and a trained model_dir's `config.yaml` gives its
settings to the next command on it ([Config files](command-line.md#config-files)).
What bad input and the output look like: [The command line](command-line.md).
The sections are `python -m engine.main --help`'s groups (`engine/cli/config/usage.py`).
"""

TABLE_HEADER = """\
| flag | default | choices | meaning |
| --- | --- | --- | --- |
"""


def _default(name: str, value: Any) -> str:
    if name == "epochs" and value is None:
        return f"{DEFAULT_EPOCHS:g} (when `--train_steps` is not set)"
    if value is None or value == ():  # No default (a repeatable flag given no times).
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Help text as one Markdown table cell: no pipes, no line breaks, `<x>` shown, not read as HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


FILE_ONLY_HEADER = """
## Settings of config files only

These have no flag: a `--config_file` or `--params_override` sets them
([Config files](command-line.md#config-files)).

| setting | default | meaning |
| --- | --- | --- |
"""


def render() -> str:
    """The whole of docs/flags.md: the flags by concern (`--help`'s groups), then the settings
    that are not flags."""
    sections, file_only = [], []
    for title, fields in grouped_settings():
        rows = []
        for field in fields:
            if not field.metadata["flag"]:
                default = _default(field.name, field_default(field))
                file_only.append(f"| `{field.name}` | {default} | {_cell(field.metadata['help'])} |\n")
                continue
            choices = field.metadata["choices"]
            meaning = _cell(field.metadata["help"])
            if field.name in CLUSTER_SETTINGS:
                meaning += " *(also `engine.server`)*"
            if field.name in SEE_ALSO:
                meaning += f" [More]({SEE_ALSO[field.name]})."
            choice_cell = ", ".join(f"`{choice}`" for choice in choices) if choices else ""
            default = _default(field.name, field.default)
            rows.append(f"| `--{field.name}` | {default} | {choice_cell} | {meaning} |\n")
        if rows:
            key = next(key for key, section in SECTIONS.items() if section.TITLE == title)
            where = f"Section `{key}` of `RunConfig`; a config file may group these as `{key}: {{...}}`.\n\n"
            sections.append(f"\n## {title}\n\n{where}{TABLE_HEADER}{''.join(rows)}")
    return HEADER + "".join(sections) + (FILE_ONLY_HEADER + "".join(file_only) if file_only else "")


if __name__ == "__main__":
    print(render(), end="")
