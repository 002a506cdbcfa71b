"""What `--help` prints for `python -m engine.main` and `python -m engine.launch`: a usage
line, the commands, examples, the most used flags with their help and the rest by name,
grouped by concern; `--helpfull` the same usage, then every engine flag with its help in
the same groups, then absl's own flags (and TensorFlow's, where imported).

absl's own `--help` opened with a module docstring and an absolute disk path, then listed
77 flags in alphabetical order over 290 lines: nothing told a new user where to start.
The groups are `RunConfig`'s sections (`SECTIONS`, each its `TITLE`, so a new field joins
the section it is written in); docs/flags.md is grouped the same way.
Imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from collections.abc import Iterable
from typing import Any

from engine.cli.config.settings.run_config import SECTIONS, flag_settings, setting_fields

# RunConfig's sections, each named at its first field (what --help and docs/flags.md head them with).
FLAG_GROUPS: tuple[tuple[str, str], ...] = tuple(
    (dataclasses.fields(section)[0].name, section.TITLE) for section in SECTIONS.values()
)

# The flags a first run needs, in the order a user meets them.
MOST_USED = (
    "model",
    "dataset",
    "label_column",
    "model_dir",
    "strategy",
    "cpu_devices",
    "epochs",
    "train_steps",
    "global_batch_size",
    "learning_rate",
    "metrics",
    "mode",
    "export_dir",
    "config_file",
)

MAIN_USAGE = """\
usage: python -m engine.main [--flag=value ...]

Trains, evaluates, predicts with and exports TensorFlow 2 models on any
tf.distribute strategy: one device, several, or a cluster. Bad input ends
with one line naming what is wrong and exit status 2.

Commands:
  python -m engine.main     train, evaluate, predict or export (this one)
  python -m engine.launch   a cluster, one process a task, here or on each host
  python -m engine.server   one cluster task's server (a parameter server)

Examples:
  python -m engine.main --strategy=mirrored --cpu_devices=2 \\
      --model_dir=runs/digits
  python -m engine.main --dataset=houses.csv --label_column=price \\
      --model=mlp --model_dir=runs/houses
  python -m engine.main --mode=eval --model_dir=runs/digits
  python -m engine.main --mode=predict --model_dir=runs/digits \\
      --predict_input=x.npz --predict_output=y.npy
  python -m engine.launch --num_workers=2 -- \\
      --strategy=multi_worker_mirrored --model_dir=runs/two
"""

LAUNCH_USAGE = """\
usage: python -m engine.launch [launcher flags] -- [engine.main flags]

Starts a whole cluster, one process a task, each with free ports and its own
TF_CONFIG: multi_worker_mirrored workers, or a chief, workers and parameter
servers. Run once on each host with --nnodes. Restarts dead tasks, passes
Ctrl-C and SIGTERM on (the tasks save first), exits with the run's status.

Examples:
  python -m engine.launch --num_workers=2 -- \\
      --strategy=multi_worker_mirrored --model_dir=runs/two
  python -m engine.launch --num_workers=2 --num_ps=1 -- \\
      --strategy=parameter_server --model_dir=runs/ps
  python -m engine.launch --nnodes=2 --node_rank=0 \\
      --rendezvous=10.0.0.10:29400 -- \\
      --strategy=multi_worker_mirrored --model_dir=/shared/runs/two
"""


def grouped_settings() -> list[tuple[str, list[dataclasses.Field]]]:
    """RunConfig's settings (flags and config-file settings) by section, in order."""
    return [(section.TITLE, list(dataclasses.fields(section))) for section in SECTIONS.values()]


def main_help(width: int | None = None) -> str:
    """`python -m engine.main --help`."""
    width = width or _terminal_width()
    fields = {field.name: field for field in setting_fields()}
    common = [
        _flag_entry(
            name, fields[name].default, fields[name].metadata["help"], fields[name].metadata["choices"], width
        )
        for name in MOST_USED
    ]
    flagged = set(flag_settings())
    rest = []
    for title, members in grouped_settings():
        names = [f"--{field.name}" for field in members if field.name in flagged and field.name not in MOST_USED]
        if names:
            rest.append(
                textwrap.fill(", ".join(names), width, initial_indent=f"  {title}: ", subsequent_indent="    ")
            )
    return (
        MAIN_USAGE
        + "\nMost used flags:\n"
        + "".join(common)
        + "\nThe other flags, by concern (--helpfull: each with its help):\n"
        + "\n".join(rest)
        + "\n"
    )


# absl's flags that are no module's (absl prints them last): every absl program takes them.
_ABSL_SPECIAL_FLAGS = (
    ("flagfile", "Reads more flags from FILE, one a line, where it stands on the command line."),
    ("undefok", "Flag names (comma-separated) that may be given though this program does not define them."),
)


def full_help(flag_values: Any, width: int | None = None) -> str:
    """`python -m engine.main --helpfull`: the usage, every engine flag with its help by concern
    (`RunConfig`'s sections, as --help and docs/flags.md), then the flags of the libraries
    (`flag_values`: absl's FlagValues) by module. absl opened with engine/main.py's docstring and
    listed its own flags before the engine's."""
    width = width or _terminal_width()
    flagged = set(flag_settings())
    parts = [MAIN_USAGE, "\nFlags, by concern (as docs/flags.md groups them):\n"]
    for title, members in grouped_settings():
        entries = [
            _flag_entry(field.name, field.default, field.metadata["help"], field.metadata["choices"], width)
            for field in members
            if field.name in flagged
        ]
        if entries:
            parts.append(f"\n{title}:\n" + "".join(entries))
    by_module = flag_values.flags_by_module_dict()
    others = sorted(module for module in by_module if not module.startswith("engine.") and "/" not in module)
    parts.append("\nThe libraries' flags (absl's; TensorFlow's where imported), by module:\n")
    for module in others:
        flags = sorted(by_module[module], key=lambda flag: flag.name)
        entries = [_flag_entry(flag.name, flag.default, flag.help or "", None, width) for flag in flags]
        parts.append(f"\n{module}:\n" + "".join(entries))
    special = [_flag_entry(name, None, text, None, width) for name, text in _ABSL_SPECIAL_FLAGS]
    parts.append("\nabsl.flags:\n" + "".join(special))
    return "".join(parts)


def launch_help(launcher_flags: Iterable[Any], width: int | None = None) -> str:
    """`python -m engine.launch --help`: its own flags (absl `Flag`s) all, with their help."""
    width = width or _terminal_width()
    entries = [_flag_entry(flag.name, flag.default, flag.help, None, width) for flag in launcher_flags]
    return LAUNCH_USAGE + "\nFlags (after --, engine.main's: python -m engine.main --help):\n" + "".join(entries)


def _flag_entry(name: str, default: Any, help: str, choices: tuple[str, ...] | None, width: int) -> str:
    """`  --name=default` then the help, indented and wrapped to `width`."""
    if isinstance(default, bool):
        head = f"  --[no]{name}" + (" (on)" if default else " (off)")
    elif default in (None, (), {}):
        head = f"  --{name}"
    else:
        shown = (
            ",".join(map(str, default))
            if isinstance(default, (list, tuple))
            else f"{default:g}"
            if isinstance(default, float)
            else default
        )
        head = f"  --{name}={shown}"
    text = " ".join(help.split()) + (f" One of: {', '.join(choices)}." if choices else "")
    return head + "\n" + textwrap.fill(text, width, initial_indent="      ", subsequent_indent="      ") + "\n"


def _terminal_width() -> int:
    return max(min(shutil.get_terminal_size().columns, 100) - 1, 40)
