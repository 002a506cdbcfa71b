"""README.md and docs/: the flag reference is what `RunConfig` says, every relative link
and anchor resolves, and every example block is found once.

Covers: engine/cli/config/flag_reference.py.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, readme_example

from engine.cli.config import flag_reference
from engine.cli.config.settings import RunConfig

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_docs_flags_md_is_what_run_config_renders():
    page = REPO / "docs" / "flags.md"
    assert page.exists(), f"docs/flags.md is missing; write it with `{flag_reference.COMMAND}`"
    assert page.read_text() == flag_reference.render(), (
        f"docs/flags.md is not what engine/cli/config/settings.py's RunConfig says; regenerate it with "
        f"`{flag_reference.COMMAND}`"
    )


def test_every_setting_is_in_the_flag_reference_with_its_help():
    text = flag_reference.render()
    for field in dataclasses.fields(RunConfig):
        # A setting without a flag (task_params) has its own table.
        row = f"| `--{field.name}` |" if field.metadata["flag"] else f"| `{field.name}` |"
        assert row in text, field.name
        assert field.metadata["help"].strip(), f"{field.name} has no help text"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where `](x)` is not a link."""
    return re.sub(r"`[^`\n]*`", "", _without_code_blocks(text))


def _anchors(page) -> set[str]:
    anchors, seen = set(), {}
    for heading in re.findall(r"^#+ (.*)$", _without_code_blocks(page.read_text()), re.M):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {os.path.relpath(target, REPO)}")
        elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
            broken.append(f"{link}: no heading #{anchor} in {os.path.relpath(target, REPO)}")
    assert broken == [], f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_flag_table_agrees_with_run_config():
    fields = {field.name: field for field in dataclasses.fields(RunConfig)}
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (`--[^|]*) \| ([^|]*) \|", readme, re.M)
    assert len(rows) >= 5, "the README's Flags section has no table of the most used flags"
    for names, default in rows:
        flags = re.findall(r"`--(\w+)`", names)
        for name in flags:
            assert name in fields, f"README names --{name}, which RunConfig does not define"
        if len(flags) == 1 and default.strip():
            rendered = flag_reference._default(flags[0], fields[flags[0]].default)
            assert default.strip() == rendered, f"README's default of --{flags[0]} is {default.strip()}"


def test_every_example_block_is_found_once():
    names = [name for page in PAGES for name in re.findall(r"<!-- example: (\w+) -->", page.read_text())]
    assert len(names) == len(set(names)), names
    for name in ("research", "step_fn", "resident", "data_forms", "callbacks", "wrapped", "two_optimizers"):
        assert name in names, name
        assert readme_example(name).strip()


@pytest.mark.process
@pytest.mark.slow  # starts a process
@pytest.mark.timeout(60)
def test_the_regenerate_command_prints_the_page_without_tensorflow():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "engine.cli.config.flag_reference"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == (REPO / "docs" / "flags.md").read_text()
    assert "tensorflow" not in result.stderr  # -X importtime lists every import


def test_the_readme_code_map_names_every_module_and_package_of_engine():
    """The README's table of the code is the layout: every flat module and package of engine/
    and engine/cli/ by its path, and every module of the packages by its name."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## The code") : text.index("## Flags")]
    engine = REPO / "engine"
    entries = [*engine.iterdir(), *(engine / "cli").iterdir()]
    paths = [
        str(path.relative_to(REPO)) + ("/" if path.is_dir() else "")
        for path in entries
        if path.name != "__init__.py" and (path.suffix == ".py" or (path / "__init__.py").exists())
    ]
    assert [path for path in paths if f"`{path}`" not in table] == []
    packages = ["loop", "checkpointing", "cluster", "launch", "callbacks", "cli/config", "cli/run"]
    modules = [path.stem for package in [*packages, "cli/process"] for path in (engine / package).glob("*.py")]
    assert [name for name in modules if name != "__init__" and f"`{name}`" not in table] == []
