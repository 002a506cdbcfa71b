"""Settings from files: `--config_file` (YAML or JSON), `--params_override`, and the
`config.yaml` that a training run keeps in its model_dir.

A command's `RunConfig` is resolved from layers, each over the ones before it:

    defaults < <model_dir>/config.yaml < --config_file files, in order < --params_override < flags

where "flags" are those given on the command line or in a --flagfile (absl's `present`), so an
unset flag never hides a file's value. The stored config.yaml is what lets a rerun with fewer
flags, `--mode=eval`, `continuous_eval` or `--mode=predict` with only `--model_dir` rebuild
the model its checkpoints hold: every setting is inherited from it except the per-invocation
ones (`PER_INVOCATION_SETTINGS`, which the file does not hold), and a model_dir with
checkpoints refuses a change of the model or the data (`MODEL_AND_DATA_SETTINGS`).

Keys are the settings' names (the flags' names, and `task_params`, which has no flag); values
are typed as the fields are (`typed`). Every mistake in a file, an override or the stored
config is one `UserError` naming where it is and the setting, raised before anything is
written. This module is imported only once the flags are parsed: PyYAML and TensorFlow
(`tf.io.gfile`: config files and model_dirs may be remote) stay out of `--help`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import tensorflow as tf
import yaml

from engine import model_dir as model_dir_lib
from engine.checkpointing import checkpointer as checkpoint_lib
from engine.checkpointing import discovery
from engine.cli.config.settings import (
    ALTERNATIVE_SETTINGS,
    COMMAND_LINE_ONLY_SETTINGS,
    DEFAULT_EPOCHS,
    MODEL_AND_DATA_SETTINGS,
    MULTI_HOST_STRATEGIES,
    PER_INVOCATION_SETTINGS,
    RunConfig,
    field_default,
    flag_settings,
)
from engine.cli.config.settings.cluster import check_cluster, resolve_multi_host
from engine.cli.config.settings.run_config import SECTIONS, setting_fields
from engine.cli.config.small_files import check_model_dir_entries, read_small_file
from engine.cluster.multi_host import MultiHostOptions
from engine.errors import UserError, one_line
from engine.options import TRAINER_GROUPS

STORED_CONFIG = "config.yaml"
# Modes that only read a model_dir; they build their model on this host alone (CheckpointedModel).
READER_MODES = ("eval", "continuous_eval", "predict")
OVERRIDE_EXAMPLE = "--params_override=learning_rate=0.01,task_params.units=128"
STORED_HEADER = (
    "# The settings this model_dir was trained with, written by engine.main before training.\n"
    "# A rerun, --mode=eval/continuous_eval and --mode=predict with --model_dir inherit them (flags,\n"
    "# --config_file and --params_override win); per-invocation settings (mode, export_dir, the\n"
    "# cluster, ...) are not kept. `--config_file=<this file> --model_dir=NEW` repeats the run.\n"
)

_FIELDS = {field.name: field for field in setting_fields()}


@dataclasses.dataclass(frozen=True)
class Layer:
    """The settings of one source, typed as `RunConfig`'s fields. `kind` is flags, override,
    file or stored; `where` names the source in messages (a file's path)."""

    kind: str
    where: str
    values: dict[str, Any]

    def spelled(self, name: str) -> str:
        """This layer's value of `name` as the user wrote it: `--model=mlp`, ..."""
        value = plain_text(self.values[name])
        if self.kind == "flags":
            return f"--{name}={value}"
        if self.kind == "override":
            return f"--params_override={name}={value}"
        return f"{name}={value} in {self.where}"

    def without(self, name: str) -> str:
        """What to do so that this layer no longer sets `name`."""
        if self.kind == "flags":
            return f"drop --{name}"
        if self.kind == "override":
            return f"drop {name} from --params_override"
        return f"remove {name} from {self.where}"


# ------------------------------------------------------------------ resolving a command's config


def config_from_flags(flag_values) -> RunConfig:
    """The checked `RunConfig` of parsed absl flags (`run_from_flags`, its cluster checked too)."""
    return run_from_flags(flag_values)[0]


def run_from_flags(flag_values) -> tuple[RunConfig, MultiHostOptions]:
    """What `engine.main` runs: the checked `RunConfig` of parsed absl flags (`resolve_config`) and
    the cluster it runs in, resolved once (`resolve_multi_host`) and checked against it."""
    config = resolve_config(flag_values)
    config.validate()
    multi_host = resolve_multi_host(config)
    check_cluster(config, multi_host)
    return config, multi_host


def resolve_config(flag_values) -> RunConfig:
    """The `RunConfig` of parsed absl flags over their config files, override and the model_dir's
    stored config.yaml, not yet validated."""
    given = {name: flag_values[name].value for name in flag_settings() if flag_values[name].present}
    command_line = Layer("flags", "the command line", given)
    files = [read_config_file(path) for path in flag_values["config_file"].value or ()]
    layers = [*files, parse_overrides(flag_values["params_override"].value), command_line]
    model_dir = _last_value(layers, "model_dir")
    mode = str(_last_value(layers, "mode") or field_default(_FIELDS["mode"]))
    if model_dir:
        check_model_dir_entries(model_dir)  # No FIFO where a command reads: it would block forever.
        model_dir_lib.check_no_record_links(model_dir)  # config.yaml is read: not through a link.
    stored = read_stored_config(model_dir) if model_dir else None
    if stored is not None:
        stored = _inherited(stored, mode)
    values = {name: field_default(field) for name, field in _FIELDS.items()}
    for layer in [stored, *layers] if stored is not None else layers:
        _apply(values, layer)
    if stored is not None and model_dir:
        check_trusted(values, stored, layers)
        check_model_and_data(values, stored, layers, model_dir)
    check_task_params_have_a_task(values, layers)
    values["config_file"] = tuple(values["config_file"] or ())
    return RunConfig(**values)


def _last_value(layers: list[Layer], name: str) -> Any:
    """The value of `name` in the last layer that sets it; None when none does."""
    for layer in reversed(layers):
        if name in layer.values:
            return layer.values[name]
    return None


def _inherited(stored: Layer, mode: str) -> Layer:
    """What a command inherits from a stored config. A reader mode runs alone on this host, so a
    strategy that needs a cluster is not inherited (`CheckpointedModel` builds a local one)."""
    values = dict(stored.values)
    if "normalize" not in values:  # Written before --normalize and the 500-step floor existed:
        values["normalize"] = "none"  # the model had no such layers, its checkpoints have none,
        if values.get("train_steps") is None and values.get("epochs") is None:
            values["epochs"] = DEFAULT_EPOCHS  # and its length was 20 epochs, no floor (it is finished).
    if mode in READER_MODES and values.get("strategy") in MULTI_HOST_STRATEGIES:
        del values["strategy"]
        values.pop("tpu", None)  # The TPU's address goes with the strategy that needs it.
    return dataclasses.replace(stored, values=values)


def _apply(values: dict[str, Any], layer: Layer) -> None:
    """`layer` over `values`: mappings (task_params) merge key by key, anything else replaces;
    a layer that sets one of a group of alternatives (train_steps, epochs) unsets the others."""
    for name, value in layer.values.items():
        if isinstance(value, dict) and isinstance(values.get(name), dict):
            values[name] = merged(values[name], value)
        else:
            values[name] = value
    for group in ALTERNATIVE_SETTINGS:
        if any(layer.values.get(name) is not None for name in group):
            for name in group:
                if name not in layer.values:
                    values[name] = field_default(_FIELDS[name])


def merged(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`update` over `base`, nested mappings merged key by key (as TF Model Garden overrides)."""
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def check_task_params_have_a_task(values: Mapping[str, Any], layers: list[Layer]) -> None:
    """task_params are the keyword arguments of a --task function: given without one (a
    --params_override=task_params.units=64 for a --model run), nothing would read them."""
    if values["task"] or not values["task_params"]:
        return
    layer = next((layer for layer in reversed(layers) if layer.values.get("task_params")), None)
    if layer is not None:  # Else only a hand-edited config.yaml holds them: the run never used them.
        raise UserError(
            f"{layer.spelled('task_params')} sets keyword arguments of a --task function, but no --task is "
            f"given; pass --task=package.module:function, or {layer.without('task_params')}"
        )


def names_code(name: str, value: Any) -> bool:
    """Whether setting `name`'s `value` makes the engine import and call code, or reach a
    machine: a `package.module:function` (--task always; --model and --dataset unless a built-in
    name, a file or tfds:NAME), or a TPU's network address."""
    if not isinstance(value, str) or not value:
        return False
    if name == "task":
        return True
    if name == "model":
        return ":" in value
    if name == "dataset":
        return (
            ":" in value and not value.startswith("tfds:") and not value.endswith((".npz", ".csv", ".parquet"))
        )
    if name == "tpu":
        return value != "local"
    return False


TRUSTED_SETTINGS = ("task", "model", "dataset", "tpu")  # The settings that can name code (names_code).


def check_trusted(values: Mapping[str, Any], stored: Layer, layers: list[Layer]) -> None:
    """A model_dir is data: the code its config.yaml names runs only if this command names it too.

    A `package.module:function` (or a TPU address) that a command would take from the stored
    config.yaml alone is refused, unless a flag, a --config_file or --params_override of this
    command gives the same value: `task: subprocess:run` with `task_params: {args: ..., shell:
    true}` in a model_dir someone hands over would otherwise run a shell command on `--mode=eval`.
    Refused before anything is imported."""
    for name in TRUSTED_SETTINGS:
        value = values[name]
        if not names_code(name, value) or stored.values.get(name) != value:
            continue
        if any(layer.values.get(name) == value for layer in layers):
            continue  # Named by this command's own flags or files: the user's choice.
        what = "a machine to send the model and data to" if name == "tpu" else "code to run"
        raise UserError(
            f"{name}={value} in {stored.where} names {what}, and a model_dir cannot choose that for you "
            f"(docs/security.md); pass --{name}={value} to trust it"
        )


def check_model_and_data(values: Mapping[str, Any], stored: Layer, layers: list[Layer], model_dir: str) -> None:
    """Refuses a model or data setting that differs from the one a model_dir's checkpoints were
    trained with (their config.yaml), naming the setting, both values and the file: the
    checkpoints would not restore, or would restore into another model."""
    if not discovery.scan_checkpoints(checkpoint_lib.checkpoint_dir(model_dir)):
        return  # Nothing trained yet: the new settings are the run's.
    for name in MODEL_AND_DATA_SETTINGS:
        if name not in stored.values or values[name] == stored.values[name]:
            continue
        layer = next((layer for layer in reversed(layers) if name in layer.values), None)
        given = layer.spelled(name) if layer else f"{name}={plain_text(values[name])}"
        raise UserError(
            f"{given} differs from {name}={plain_text(stored.values[name])} that {stored.where} was "
            f"trained with; use a new --model_dir, or {layer.without(name) if layer else f'pass --{name}'}"
        )


# ------------------------------------------------------------------ files and overrides


def read_config_file(path: str) -> Layer:
    """The settings of a --config_file: a YAML or JSON (.json) mapping of setting names."""
    where = f"--config_file={path}"
    if not path:
        raise UserError("--config_file= names no file; pass --config_file=PATH of a YAML or JSON file")
    text = _read_text(path, where, fix="pass a readable YAML or JSON file")
    data = _parse(path, text, where, fix="fix the file")
    if data is None:  # Empty, or only comments: it sets nothing.
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"{where} holds {_kind_of(data)}, not a mapping of settings; write one NAME: VALUE a line "
            "(the flags' names, e.g. model: mlp)"
        )
    values = {}
    for key, value in _ungrouped(data, where).items():
        name = setting_name(key, where, fix="use the flags' names (docs/flags.md) or task_params")
        if name in COMMAND_LINE_ONLY_SETTINGS:
            raise UserError(f"{where}: {name} is a setting of the command line only; pass --{name} there")
        values[name] = typed(name, value, where, example=lambda name, value: f"write {name}: {value}")
    return Layer("file", path, values)


def _grouped_names() -> dict[str, tuple[str, ...]]:
    """The keys a config file may spell as a group, each with the settings it holds: `RunConfig`'s
    sections (`schedule: {train_steps: 100}`) and the Trainer's option groups (`checkpoint:
    {max_checkpoints: 5}`, `engine.options.TRAINER_GROUPS`, their options that are settings)."""
    names = {
        key: tuple(field.name for field in dataclasses.fields(section)) for key, section in SECTIONS.items()
    }
    for key, group in TRAINER_GROUPS.items():
        options = tuple(field.name for field in dataclasses.fields(group) if field.name in _FIELDS)
        names[key] = tuple(dict.fromkeys((*names.get(key, ()), *options)))
    return names


def _ungrouped(data: dict[Any, Any], where: str) -> dict[Any, Any]:
    """A config file's mapping with each group spelled as one (a section or an option group over
    its settings, `_grouped_names`) as the settings of their flat names (`max_checkpoints: 5`); a
    setting given both ways is refused."""
    groups = _grouped_names()
    flat = {key: value for key, value in data.items() if key not in groups or key in _FIELDS}
    for key, options in groups.items():
        if key not in data or key in _FIELDS:
            continue
        if not isinstance(data[key], dict):
            raise UserError(
                f"{where}: {key} holds {_kind_of(data[key])}, not a mapping of its options; write e.g. "
                f"{key}: {{{options[0]}: {plain_text(field_default(_FIELDS[options[0]]))}}}"
            )
        for name, value in data[key].items():
            if name not in options:
                raise UserError(
                    f"{where}: {key}.{name} is not an option of {key} that the command line sets; "
                    f"{key} holds {', '.join(options)}"
                )
            if name in flat:
                raise UserError(f"{where} sets {name} twice, as {name} and as {key}.{name}; keep one")
            flat[name] = value
    return flat


def parse_overrides(text: str | None) -> Layer:
    """`--params_override=NAME=VALUE,...`: each VALUE read as YAML and typed as its setting; a
    dotted NAME (task_params.units) sets a key of a mapping setting."""
    values: dict[str, Any] = {}
    for item in _top_level_items(text or ""):
        item = item.strip()
        if not item:
            continue
        where = f"--params_override item {item!r}"
        dotted, sep, raw = item.partition("=")
        head, *path = dotted.strip().split(".")
        if head in SECTIONS and head not in _FIELDS and len(path) == 1:  # A section's spelling: schedule.epochs.
            head, path = path[0], []
        if not sep or not head:
            raise UserError(f"--params_override: {item!r} is not NAME=VALUE; write e.g. {OVERRIDE_EXAMPLE}")
        name = setting_name(head, where, fix="use the flags' names (docs/flags.md) or task_params")
        if name in COMMAND_LINE_ONLY_SETTINGS:
            raise UserError(f"{where}: {name} cannot be overridden; pass --{name} on the command line")
        value = _parse(where, raw, where, fix="quote a value that holds commas, brackets or colons")
        if path:
            if not str(_FIELDS[name].type).startswith("dict") or not all(path):
                raise UserError(
                    f"{where}: {name} is not a mapping; only task_params takes dotted names "
                    "(task_params.NAME=VALUE)"
                )
            for key in reversed(path):
                value = {key: value}
        raw_text = None if path else raw.strip()
        example = lambda name, value: f"pass {name}={value}"  # noqa: E731
        value = typed(name, value, "--params_override", raw=raw_text, example=example)
        values[name] = merged(values[name], value) if isinstance(values.get(name), dict) else value
    return Layer("override", "--params_override", values)


def _top_level_items(text: str) -> Iterator[str]:
    """`text` split at the commas outside brackets, braces and quotes."""
    closing = {"[": "]", "{": "}"}
    depth: list[str] = []
    quote = ""
    start = 0
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in closing:
            depth.append(closing[char])
        elif depth and char == depth[-1]:
            depth.pop()
        elif char == "," and not depth:
            yield text[start:index]
            start = index + 1
    if quote or depth:
        raise UserError(
            f"--params_override={text}: an unclosed {quote or 'bracket'}; close it, e.g. {OVERRIDE_EXAMPLE}"
        )
    yield text[start:]


def setting_name(key: Any, where: str, *, fix: str) -> str:
    """`key` if it names a setting; otherwise one line with the closest name."""
    if isinstance(key, str) and key in _FIELDS:
        return key
    close = difflib.get_close_matches(str(key), list(_FIELDS), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise UserError(f"{where}: unknown setting {key!r}{hint}; {fix}")


# ------------------------------------------------------------------ types


_EXAMPLES = {"int": 10, "float": 0.001, "bool": "true", "str": "'text'", "list[str]": "[host:port, host:port]"}
_NAMED_EXAMPLES = {"column_types": "{zip: category, id: drop}"}
_WHAT = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "list[str]": "a list of strings",
    "dict[str, Any]": "a mapping",
}


def typed(name: str, value: Any, where: str, *, raw: str | None = None, example=None) -> Any:
    """`value` (as YAML or JSON read it) as setting `name`'s type. Numbers may be strings (PyYAML
    reads 1e-3 as one), integers are floats where a float is due, a list may be one string split
    at commas or semicolons (host:1;host:2), and with `raw` (an override's text) a string setting
    takes the text YAML read as a number. Anything else is one line naming `where` and `name`."""
    kind = str(_FIELDS[name].type)
    optional = kind.endswith(" | None")
    base = kind.removesuffix(" | None")
    if name == "column_types" and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        value = [f"{key}:{kind}" for key, kind in value.items()]  # {zip: category}: NAME:TYPE entries.
    converted = _converted(base, value, optional, raw)
    if converted is _WRONG:
        default = _FIELDS[name].default
        if base == "str" and isinstance(value, (bool, int, float)):
            shown = f"'{plain_text(value)}'"  # YAML read a number: quoted, it is the string.
        elif name in _NAMED_EXAMPLES:
            shown = _NAMED_EXAMPLES[name]
        elif base == "list[str]" or default is None or default is dataclasses.MISSING:
            shown = str(_EXAMPLES.get(base, "{units: 128}"))
        else:
            shown = plain_text(default)
        fix = (example or (lambda name, value: f"write {name}: {value}"))(name, shown)
        null = " or null" if optional else ""
        raise UserError(f"{where}: {name}={plain_text(value)} is not {_WHAT[base]}{null}; {fix}")
    return converted


_WRONG = object()


def _converted(base: str, value: Any, optional: bool, raw: str | None) -> Any:
    if value is None:
        return None if optional else {} if base.startswith("dict") else _WRONG
    if base == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value if isinstance(value, bool) else _WRONG
    if base in ("int", "float"):
        return _number(base, value)
    if base == "str":
        if isinstance(value, str):
            return value
        scalar = isinstance(value, (bool, int, float)) or type(value).__module__ == "datetime"
        return raw if raw is not None and scalar else _WRONG
    if base == "list[str]":
        if isinstance(value, str):
            value = [part.strip() for part in value.replace(";", ",").split(",") if part.strip()]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            return _WRONG
        return value
    if base.startswith("dict"):
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            return _WRONG
        return value
    raise AssertionError(f"no conversion from config files to {base}")


def _number(base: str, value: Any) -> Any:
    """`value` as the int or float `base` names (a string parsed), or _WRONG."""
    if isinstance(value, str):
        try:
            value = int(value) if base == "int" else float(value)
        except ValueError:
            return _WRONG
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _WRONG
    if base == "int":
        return value if isinstance(value, int) else _WRONG
    return float(value)


def plain_text(value: Any) -> str:
    """A value as a message shows it: strings bare, the rest as YAML's flow style writes it."""
    if isinstance(value, str):
        return value
    text = yaml.safe_dump(_yaml_types(value), default_flow_style=True, width=2**16)
    return text.removesuffix("\n...\n").strip()  # A scalar document ends with "...".


def _kind_of(data: Any) -> str:
    return "a list" if isinstance(data, list) else f"a {type(data).__name__}"


# ------------------------------------------------------------------ reading and parsing


def _read_text(path: str, where: str, *, fix: str) -> str:
    """A config file's text: a regular file of at most 1 MiB (small_files), UTF-8."""
    data = read_small_file(path, where, fix=fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{where} is not a text file (byte {data[error.start]:#04x} at offset {error.start} is not UTF-8); "
            f"{fix}"
        ) from None


def _parse(path: str, text: str, where: str, *, fix: str, damaged: bool = False) -> Any:
    """`text` as JSON (a .json path) or YAML, a key given twice in one mapping refused.
    `damaged`: the file was written by the engine, so bad text is damage, not a typo."""
    is_not = "is damaged: not valid" if damaged else "is not valid"
    try:
        if path.endswith(".json"):
            data = json.loads(text, object_pairs_hook=_unique_pairs)
            _check_json_size(data)
            return data
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except json.JSONDecodeError as error:
        raise UserError(f"{where} {is_not} JSON ({error}); {fix}") from None
    except RecursionError:  # json's own parser, nested deeper than Python's stack.
        raise UserError(f"{where}: {_TooLarge.deep()}; {fix}") from None
    except yaml.YAMLError as error:
        raise UserError(f"{where} {is_not} YAML ({_yaml_problem(error)}); {fix}") from None
    except (_DuplicateKey, _TooLarge) as error:
        raise UserError(f"{where}: {error}; {fix}") from None


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"{key!r} is set twice")
        result[key] = value
    return result


# What a file of settings may hold, counted as YAML composes it, aliases expanded: a 1 KB file of
# nested aliases (a "billion laughs") expands to billions of values, which every later step (typing,
# merging, printing, copying the config) walks; nested 20,000 deep, it overflows Python's stack.
MAX_VALUES = 10_000  # Scalars, lists and mappings; a config holds about a hundred.
MAX_DEPTH = 50  # Lists and mappings inside each other.


class _TooLarge(ValueError):
    @staticmethod
    def deep() -> str:
        return f"it nests lists or mappings more than {MAX_DEPTH} deep; a config file is a few levels deep"

    @staticmethod
    def many() -> str:
        return f"it holds more than {MAX_VALUES} values (aliases expanded); a config file holds about a hundred"


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader refusing a key set twice in one mapping (it keeps the last one), and
    bounded: it counts every node as it composes it, an alias as the whole node it names, and
    refuses more than MAX_VALUES of them, nesting deeper than MAX_DEPTH (an alias adds the depth of
    what it names), and an alias inside the node it names (an endless structure). Aliases stay
    allowed (anchors and `<<: *defaults` merges are ordinary YAML); only what they expand to counts.
    The check runs before anything is constructed, in time linear in the file's length."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._values = 0  # Nodes composed so far, aliases expanded.
        self._depth = 0  # The depth of the node being composed.
        self._deepest = 0  # The deepest level reached so far, aliases expanded.
        self._expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (its values, its height)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            anchor = self.peek_event().anchor
            node = self.anchors.get(anchor)
            if node is not None:  # Else PyYAML's own "found undefined alias".
                if id(node) not in self._expanded:
                    raise _TooLarge(
                        f"alias *{anchor} is inside the node &{anchor} it names (an endless structure)"
                    )
                values, height = self._expanded[id(node)]
                self._count(values, self._depth + height)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _TooLarge(_TooLarge.deep())
        values_before, deepest_before = self._values, self._deepest
        self._deepest = self._depth
        node = super().compose_node(parent, index)
        self._count(1, self._depth)
        self._expanded[id(node)] = (self._values - values_before, self._deepest - self._depth + 1)
        self._deepest = max(self._deepest, deepest_before)
        self._depth -= 1
        return node

    def _count(self, values: int, deepest: int) -> None:
        self._values += values
        self._deepest = max(self._deepest, deepest)
        if self._values > MAX_VALUES:
            raise _TooLarge(_TooLarge.many())
        if self._deepest > MAX_DEPTH:
            raise _TooLarge(_TooLarge.deep())


def _check_json_size(data: Any) -> None:
    """The JSON form of `_StrictLoader`'s bounds (JSON has no aliases: a walk counts them)."""
    pending, values = [(data, 1)], 0
    while pending:
        value, depth = pending.pop()
        values += 1
        if values > MAX_VALUES:
            raise _TooLarge(_TooLarge.many())
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _TooLarge(_TooLarge.deep())
            children = value.values() if isinstance(value, dict) else value
            pending.extend((child, depth + 1) for child in children)


def _unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Hashable] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, Hashable) and key in seen:
            mark = key_node.start_mark
            raise _DuplicateKey(f"{key!r} is set twice (again at line {mark.line + 1})")
        if isinstance(key, Hashable):
            seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or one_line(error, 120)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


# ------------------------------------------------------------------ the stored config.yaml


def stored_config_path(model_dir: str) -> str:
    return os.path.join(model_dir, STORED_CONFIG)


def read_stored_config(model_dir: str) -> Layer | None:
    """The settings `<model_dir>/config.yaml` holds, but the per-invocation ones; None without one
    (a model_dir of an older run, or a new one). A damaged file is one line naming it."""
    path = stored_config_path(model_dir)
    if not tf.io.gfile.exists(path):
        return None
    fix = "restore it from a backup or move it away (the run then uses only this command's settings)"
    text = _read_text(path, f"{path} (the settings the run was trained with)", fix=fix)
    data = _parse(path, text, f"{path} (the settings the run was trained with)", fix=fix, damaged=True)
    if not isinstance(data, dict):
        raise UserError(f"{path} (the settings the run was trained with) is damaged: not a mapping; {fix}")
    values = {}
    for key, value in data.items():
        name = setting_name(key, path, fix=f"remove it from the file, or {fix}")
        if name in PER_INVOCATION_SETTINGS:
            continue  # Never inherited (and not written: a hand edit).
        values[name] = typed(name, value, path, example=lambda name, value: f"write {name}: {value} there")
    return Layer("stored", path, values)


def stored_settings(config: RunConfig) -> dict[str, Any]:
    """What config.yaml holds: every setting a rerun on the model_dir inherits."""
    return {name: value for name, value in config.settings().items() if name not in PER_INVOCATION_SETTINGS}


def printed_settings(config: RunConfig) -> dict[str, Any]:
    """What --print_config shows: every setting a --config_file may hold."""
    return {name: value for name, value in config.settings().items() if name not in COMMAND_LINE_ONLY_SETTINGS}


def as_yaml(settings: Mapping[str, Any]) -> str:
    """Settings as the YAML a --config_file holds, in RunConfig's order."""
    return yaml.safe_dump(_yaml_types(dict(settings)), sort_keys=False, allow_unicode=True, width=100)


def check_stored_config_writable(model_dir: str) -> None:
    """Before the first write: a directory where config.yaml goes is refused, not a traceback."""
    path = stored_config_path(model_dir)
    if tf.io.gfile.isdir(path):
        raise UserError(f"{path} is a directory; move it away, the run writes its settings there")


def write_stored_config(model_dir: str, config: RunConfig) -> None:
    """Writes `<model_dir>/config.yaml` atomically (a temporary file in model_dir, then a rename)."""
    text = STORED_HEADER + as_yaml(stored_settings(config))
    model_dir_lib.write_atomically(stored_config_path(model_dir), text)


def _yaml_types(value: Any) -> Any:
    """Tuples as lists, recursively: what yaml.safe_dump writes."""
    if isinstance(value, (list, tuple)):
        return [_yaml_types(item) for item in value]
    if isinstance(value, dict):
        return {key: _yaml_types(item) for key, item in value.items()}
    return value
