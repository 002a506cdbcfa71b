"""The tests' way of changing this process's environment (`helpers.environment`): one variable
at a time, never the whole environment cleared and set again while TensorFlow's threads of the
worker may read it (glibc's getenv against setenv/unsetenv: a worker crashed so, SIGSEGV)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

from helpers import environment

TESTS = Path(__file__).resolve().parents[1]


def test_no_change_touches_nothing_and_each_change_is_put_back_alone():
    before = dict(os.environ)
    name, present = "ENGINE_TEST_ONLY_VARIABLE", next(iter(os.environ))
    with mock.patch.object(os, "putenv") as putenv, mock.patch.object(os, "unsetenv") as unsetenv:
        with environment():
            pass
        with environment(None):
            pass
        assert putenv.call_count == unsetenv.call_count == 0
        with environment({name: "1", present: None}):
            assert os.environ[name] == "1" and present not in os.environ
        assert putenv.call_count == 2 and unsetenv.call_count == 2  # In and back, of these two alone.
    assert dict(os.environ) == before


def test_a_change_is_put_back_after_an_error():
    name = "ENGINE_TEST_ONLY_VARIABLE"
    try:
        with environment({name: "1"}):
            raise KeyError(name)
    except KeyError:
        pass
    assert name not in os.environ


def test_no_test_patches_the_whole_environment():
    whole = re.compile(r"patch\.dict\(\s*os\." + "environ")
    offenders = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if whole.search(line)
    ]
    assert offenders == [], "use helpers.environment: " + ", ".join(offenders)
