"""Library messages in the command line's spelling.

The library (`engine`) names its own arguments in its errors, in backticks,
as Python code: "pass `restore_fallback=True` ...", "`collective_timeout=-1.0`
must be >= 0". A command-line user never called those functions, so the
command line prints the flag instead (`in_flag_terms`):

- `` `name=value` `` becomes `--name=value` (a string value without its quotes,
  a list joined by commas, `True` as `--name` and `False` as `--noname`);
- `` `name` `` becomes `--name`;
- `` `Callable(name=value)` `` becomes `--flag=value` where the table below maps
  that callable's argument to a flag (generic names such as a hook's `metric`).

Only names that are flags (`RunConfig` fields, or library names the tables
map to one) are translated; every other backticked text is left as it is.
This module imports no TensorFlow.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import re
from collections.abc import Iterator

from engine.cli.config.settings import flag_settings
from engine.errors import UserError

# Library argument names that differ from the flag they back.
RENAMED = {
    "schedule": "lr_schedule",  # engine.schedules.learning_rate_schedule(schedule, ...)
}

# Arguments whose name alone is too generic to stand for one flag, by the callable they belong to.
QUALIFIED = {
    "BestCheckpoint(metric)": "best_checkpoint_metric",
    "EarlyStopping(metric)": "early_stop_metric",
    "ReduceLROnPlateau(metric)": "reduce_lr_metric",
    "ReduceLROnPlateau(factor)": "reduce_lr_factor",
    "ReduceLROnPlateau(min_rate)": "min_learning_rate",
    "WeightHistograms(every)": "histogram_every",
}

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_PLAIN = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:=(?P<value>.*))?", re.DOTALL)
_CALL = re.compile(r"(?P<callable>[A-Za-z_][\w.]*)\((?P<name>[A-Za-z_]\w*)(?:=(?P<value>.*))?\)", re.DOTALL)


@functools.cache
def flag_names() -> frozenset[str]:
    """Every flag of `engine.main` (the RunConfig fields that are flags, the cluster's among them)."""
    return frozenset(flag_settings())


def _flag_value(text: str) -> str:
    """A Python literal as the command line spells it: strings unquoted, lists comma-joined."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(item, (str, int, float)) for item in value):
        return ",".join(str(item) for item in value)
    return text


def _as_flag(flag: str, value: str | None) -> str:
    if value is None:
        return f"--{flag}"
    if value.strip() == "True":
        return f"--{flag}"
    if value.strip() == "False":
        return f"--no{flag}"
    return f"--{flag}={_flag_value(value)}"


def _translate(match: re.Match) -> str:
    text = match.group(1)
    call = _CALL.fullmatch(text)
    if call is not None:
        flag = QUALIFIED.get(f"{call['callable'].rsplit('.', 1)[-1]}({call['name']})")
        if flag is not None:
            return _as_flag(flag, call["value"])
        name = RENAMED.get(call["name"], call["name"])
        return _as_flag(name, call["value"]) if name in flag_names() else match.group(0)
    plain = _PLAIN.fullmatch(text)
    if plain is not None:
        name = plain["name"]
        flag = RENAMED.get(name, name)
        if flag in flag_names():
            return _as_flag(flag, plain["value"])
    return match.group(0)


def in_flag_terms(message: str | BaseException) -> str:
    """`message` (a library error's text) with every backticked library argument
    that backs a flag spelled as that flag; the rest unchanged."""
    return _BACKTICKED.sub(_translate, str(message))


@contextlib.contextmanager
def errors_in_flag_terms() -> Iterator[None]:
    """A UserError the block raises (a library check the command line runs) leaves it
    spelled in flags: the same exception, its message translated."""
    try:
        yield
    except UserError as error:
        error.args = (in_flag_terms(error), *error.args[1:])
        raise


class FlagTermsFilter(logging.Filter):
    """Log lines in flag terms too: the library's warnings (a remote `model_dir` has no
    writer lock) name its arguments; `engine.main` puts this on its log handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # A bad format: the handler reports it as it would.
            return True
        if "`" in message:
            record.msg, record.args = in_flag_terms(message), None
        return True
