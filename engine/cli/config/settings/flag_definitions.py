"""absl flags defined from `RunConfig`'s fields: type, default, help and choices (`define_flags`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from absl import flags

from engine.cli.config.settings.fields import choice_message
from engine.cli.config.settings.run_config import setting_fields

_DEFINE_BY_TYPE = {  # A field's annotation (a string under `from __future__ import annotations`) -> its flag.
    "str": "DEFINE_string",
    "str | None": "DEFINE_string",
    "int": "DEFINE_integer",
    "int | None": "DEFINE_integer",
    "float": "DEFINE_float",
    "float | None": "DEFINE_float",
    "bool": "DEFINE_boolean",
    "list[str] | None": "DEFINE_list",
    "tuple[str, ...]": "DEFINE_multi_string",
}


def define_flags(names: Sequence[str], *, module_name: str, flag_values=None) -> None:
    """Defines `--NAME` for each named `RunConfig` field from its default and help, as flags of
    `module_name` (what `--help` and `adopt_module_key_flags` go by); a field with choices becomes
    an enum (listed by `--help`) whose bad value gets `validate`'s one-line message."""
    flag_values = flags.FLAGS if flag_values is None else flag_values
    fields = {field.name: field for field in setting_fields()}
    for name in names:
        field = fields[name]
        assert field.metadata["flag"], f"{name} is a setting of config files only, not a flag"
        choices = field.metadata["choices"]
        if choices is None:
            define = getattr(flags, _DEFINE_BY_TYPE[str(field.type)])
            define(name, field.default, field.metadata["help"], flag_values=flag_values, module_name=module_name)
            continue
        assert field.default is not dataclasses.MISSING, f"the choice field {name} needs a default"
        flag = flags.EnumFlag(name, field.default, field.metadata["help"], choices)
        flag.parser = _ChoiceParser(name, choices)
        flags.DEFINE_flag(flag, flag_values=flag_values, module_name=module_name)


class _ChoiceParser(flags.EnumParser):
    """absl's enum parser with `_choose`'s message, so that a bad --NAME=VALUE reads the same
    on the command line as from `RunConfig(...).validate()`."""

    def __init__(self, name: str, choices: Sequence[str]):
        super().__init__(choices)
        self.name = name

    def parse(self, argument: str) -> str:
        if argument not in self.enum_values:
            raise ValueError(choice_message(self.name, argument, self.enum_values))
        return argument
