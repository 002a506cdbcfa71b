"""Importing a user's `package.module:function` named by a setting (--model, --dataset, --task).

One place for how a user's code is found (the working directory and the
Python path) and for the one-line message when it cannot be used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class UserCodeError(ValueError):
    """A `package.module:function` that cannot be imported or is not a function."""


def import_callable(value: str, *, setting: str) -> tuple[Callable[..., Any], str]:
    """(the function, where it was found) for `value` = package.module:function; the message
    of a UserCodeError names `--setting=value`."""
    module_name, _, function_name = value.partition(":")
    if not module_name or not function_name.isidentifier():
        raise UserCodeError(
            f"--{setting}={value} must be package.module:function, e.g. --{setting}=my_{setting}s:build"
        )
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # Any failure in the user's module, sys.exit() included.
        raise UserCodeError(
            f"--{setting}={value}: cannot import {module_name!r}: {type(error).__name__}: {first_line(error)}"
        ) from None
    where = getattr(module, "__file__", None) or "built in"
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserCodeError(f"--{setting}={value}: {module_name!r} ({where}) has no function {function_name!r}")
    return function, where


def first_line(error: BaseException) -> str:
    """The first line of an error's text, even when its __str__ fails."""
    try:
        text = str(error)
    except Exception:  # An exception whose __str__ fails: its repr still says what it is.
        text = object.__repr__(error)
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""
