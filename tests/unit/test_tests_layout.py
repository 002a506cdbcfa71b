"""The tests mirror the code: every module of engine/ with logic (over 40 lines, defining a
function or a class) is named by a test file, either `tests/**/test_<name>.py` (a package's
`__init__.py` by the package's name) or a `Covers:` line in the module docstring of a test
file named for what it claims ("Covers: engine/x.py, engine/y.py."), so that a reader finds
a module's tests from its name. A new module, or one moved or split, is named the same way.
"""

import ast
import re
from pathlib import Path

import pytest
from helpers import REPO, make_trainer

ENGINE = REPO / "engine"
TESTS = REPO / "tests"
LOGIC_LINES = 40  # Shorter modules (constants, re-exports, an entry point's lines) need no tests of their own.
# Modules with logic that no test file names yet. The list may only shrink: a module named
# since must leave it, and a new module is named by a test file instead of joining it.
NOT_NAMED_YET: frozenset[str] = frozenset()
COVERS = re.compile(r"^Covers:\s*(.*?)\s*(?:\n\s*\n|\Z)", re.MULTILINE | re.DOTALL)


def _has_logic(path: Path) -> bool:
    text = path.read_text()
    if len(text.splitlines()) <= LOGIC_LINES:
        return False
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) for node in ast.walk(ast.parse(text, str(path))))


def _name(path: Path) -> str:
    """The name a test file takes for `path`: its own, or its package's for an `__init__.py`."""
    return path.parent.name if path.name == "__init__.py" else path.stem


def covered(docstring: str) -> list[str]:
    """The paths of a docstring's `Covers:` paragraph (it may wrap over several lines)."""
    found = COVERS.search(docstring)
    if not found:
        return []
    return [name.strip().rstrip(".") for name in found.group(1).replace("\n", " ").split(",") if name.strip()]


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _covers_lines() -> dict[str, list[str]]:
    """Test file -> the modules its `Covers:` line names."""
    lines = {}
    for path in _test_files():
        docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
        if covered(docstring):
            lines[str(path.relative_to(REPO))] = covered(docstring)
    return lines


def _modules_not_named() -> set[str]:
    test_names = {path.stem.removeprefix("test_") for path in _test_files()}
    in_covers = {module for modules in _covers_lines().values() for module in modules}
    return {
        str(path.relative_to(REPO))
        for path in ENGINE.rglob("*.py")
        if _has_logic(path) and _name(path) not in test_names and str(path.relative_to(REPO)) not in in_covers
    }


def test_every_engine_module_with_logic_is_named_by_a_test_file():
    not_named = _modules_not_named()
    assert not_named - NOT_NAMED_YET == set(), (
        "no test file names these modules: put their tests in tests/<folder>/test_<name>.py, or add "
        "them to the `Covers:` line of the docstring of the test file that holds their tests"
    )
    assert NOT_NAMED_YET - not_named == set(), "named by a test file now: remove them from NOT_NAMED_YET"


def test_every_covers_line_names_engine_modules_that_exist():
    stale = {
        test: [module for module in modules if not (module.startswith("engine/") and (REPO / module).is_file())]
        for test, modules in _covers_lines().items()
    }
    assert {test: modules for test, modules in stale.items() if modules} == {}


def test_a_covers_line_is_read_over_its_wrapped_lines_and_ends_at_its_paragraph():
    docstring = "What it claims.\n\nCovers: engine/a.py, engine/b/c.py,\nengine/d.py.\n\nMore prose, not paths."
    assert covered(docstring) == ["engine/a.py", "engine/b/c.py", "engine/d.py"]
    assert covered("What it claims, with no line of modules.") == []


# A Trainer constructed by name (`engine.Trainer(`, `Trainer(`, `CoordinatedTrainer(`), not through
# `helpers.make_trainer`; a mention in backticks (a message's text) is no call.
DIRECT_TRAINER = re.compile(r"(?<![\w`])(?:Coordinated)?Trainer\(")
RAW_MARK = "# raw Trainer: "  # Then why this test calls the constructor itself.


def direct_trainer_calls(text: str) -> list[int]:
    """The lines of `text` that construct a Trainer by name without the mark saying why."""
    return [
        number
        for number, line in enumerate(text.splitlines(), 1)
        if DIRECT_TRAINER.search(line) and not re.search(re.escape(RAW_MARK) + r"\S", line)
    ]


def test_every_trainer_of_the_tests_is_built_through_make_trainer_or_says_why_not():
    # make_trainer takes the option groups only, so a test that goes through it is a test of the
    # spelling the docs teach; the tests of the raw constructor (the flat shim, the class itself)
    # say so on the line.
    unmarked = {
        str(path.relative_to(REPO)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve() and (lines := direct_trainer_calls(path.read_text()))
    }
    assert unmarked == {}, (
        "build these Trainers with helpers.make_trainer (option groups), or end the line with "
        f"`{RAW_MARK}<why>` where the constructor itself is the point"
    )


def test_a_direct_trainer_call_is_found_and_a_marked_one_or_a_mention_is_not():
    text = (
        "trainer = engine.Trainer(\n"
        "t = CoordinatedTrainer(strategy)\n"
        "t = make_trainer(strategy)\n"
        "engine.Trainer(**arguments)  # raw Trainer: the flat shim\n"
        "engine.Trainer(**arguments)  # raw Trainer:\n"
        'message = "`Trainer(clip_norm=1.0)` is"\n'
        "t = ClassifierTrainer(model)\n"
    )
    assert direct_trainer_calls(text) == [1, 2, 5]


def test_make_trainer_refuses_a_flat_alias_before_it_builds_anything():
    refused = r"option groups, not the flat aliases \['clip_norm', 'steps_per_loop'\]"
    with pytest.raises(AssertionError, match=refused):
        make_trainer(steps_per_loop=2, clip_norm=1.0)
