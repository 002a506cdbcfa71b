"""Importing a user's `package.module:function` named by a setting (--model, --dataset, --task).

One place for how a user's code is found (the working directory and the
Python path) and for the one-line message when it cannot be used.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


class UserCodeError(ValueError):
    """A `package.module:function` that cannot be imported or is not a function."""


def import_callable(
    value: str, *, setting: str, example: str | None = None, signature: str | None = None
) -> tuple[Callable[..., Any], str]:
    """(the function, where it was found) for `value` = package.module:function; the message
    of a UserCodeError names `--setting=value`, the `example` value to give, and the
    `signature` (e.g. "(input_shape, num_classes) -> keras.Model") a missing function needs."""
    module_name, _, function_name = value.partition(":")
    if not module_name or not function_name.isidentifier():
        example = example or f"my_{setting}s:build"
        raise UserCodeError(f"--{setting}={value} must be package.module:function, e.g. --{setting}={example}")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # Any failure in the user's module, sys.exit() included.
        raise UserCodeError(
            f"--{setting}={value}: cannot import {module_name!r}: {type(error).__name__}: {first_line(error)}"
        ) from None
    where = getattr(module, "__file__", None) or "built in"
    function = getattr(module, function_name, None)
    if not callable(function):
        define = f"; define {function_name}{signature}" if signature else ""
        raise UserCodeError(
            f"--{setting}={value}: {module_name!r} ({where}) has no function {function_name!r}{define}"
        )
    return function, where


def signature_text(function: Callable[..., Any]) -> str:
    """`(a, b=1)` for messages; `(...)` where Python cannot inspect it (a builtin)."""
    try:
        return str(inspect.signature(function))
    except ValueError:
        return "(...)"


def first_line(error: BaseException) -> str:
    """The first line of an error's text, even when its __str__ fails."""
    try:
        text = str(error)
    except Exception:  # An exception whose __str__ fails: its repr still says what it is.
        text = object.__repr__(error)
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


def exited(error: SystemExit, returns: str) -> str:
    """What a user's function did that called sys.exit() (or `exit()`) while the engine called it
    for `returns` ("its data"): said as one line instead of ending the run in silence, status 0."""
    return f"called sys.exit({error.code!r}) instead of returning {returns}; return it, or raise an exception"
