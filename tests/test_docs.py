"""docs/flags.md is what `RunConfig` says."""

import dataclasses
import os
import subprocess
import sys

import pytest
from helpers import REPO

from engine import flag_reference
from engine.config import RunConfig


def test_docs_flags_md_is_what_run_config_renders():
    page = REPO / "docs" / "flags.md"
    assert page.exists(), f"docs/flags.md is missing; write it with `{flag_reference.COMMAND}`"
    assert page.read_text() == flag_reference.render(), (
        f"docs/flags.md is not what engine/config.py's RunConfig says; regenerate it with "
        f"`{flag_reference.COMMAND}`"
    )


def test_every_setting_is_in_the_flag_reference_with_its_help():
    text = flag_reference.render()
    for field in dataclasses.fields(RunConfig):
        assert f"| `--{field.name}` |" in text, field.name
        assert field.metadata["help"].strip(), f"{field.name} has no help text"


@pytest.mark.slow  # starts a process
@pytest.mark.timeout(60)
def test_the_regenerate_command_prints_the_page_without_tensorflow():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "engine.flag_reference"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == (REPO / "docs" / "flags.md").read_text()
    assert "tensorflow" not in result.stderr  # -X importtime lists every import
