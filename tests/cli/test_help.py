"""`--help` of `python -m engine.main` and `python -m engine.launch`: what the tool is and how
to start in its first lines, the most used flags with their help, every other flag by name
in its group, no disk path, and nothing wider than the terminal. (The commands themselves,
their exit status and that they import no TensorFlow: tests/process/test_cli_output.py.)

`--helpfull` opens with the same usage, then every engine flag with its help in the same
groups, absl's own flags after them.

Covers: engine/cli/config/usage.py.
"""

import re

from absl import flags
from helpers import REPO

from engine.cli.config.settings import flag_settings
from engine.cli.config.usage import FLAG_GROUPS, MOST_USED, full_help, grouped_settings, launch_help, main_help
from engine.launch import launcher

ENTRY = re.compile(r"^  --(?:\[no\])?(\w+)")  # `  --model=cnn`, `  --[no]evaluator (off)`


def _listed(text: str) -> tuple[list[str], list[str]]:
    """The flags shown with their help, and those named in the groups' lines."""
    entries = [match.group(1) for line in text.splitlines() if (match := ENTRY.match(line))]
    groups = text.split("The other flags, by concern", 1)[1] if "The other flags" in text else ""
    return entries, re.findall(r"--(\w+)", groups.split("\n", 1)[1]) if groups else []


def test_main_help_starts_with_what_it_is_and_how_to_start():
    lines = main_help(width=79).splitlines()
    assert lines[0] == "usage: python -m engine.main [--flag=value ...]"
    first = "\n".join(lines[:15])
    assert "TensorFlow" in first and "Commands:" in first
    for command in ("engine.main", "engine.launch", "engine.server"):
        assert f"  python -m {command} " in first, command
    assert "Examples:" in first


def test_main_help_shows_the_most_used_flags_first_and_names_every_other_once():
    text = main_help(width=79)
    entries, grouped = _listed(text)
    assert entries == list(MOST_USED)
    assert sorted(entries + grouped) == sorted(flag_settings())  # Each flag once, none left out.
    assert str(REPO) not in text and "/engine/" not in text  # absl's heading was a disk path.
    assert max(len(line) for line in text.splitlines()) <= 79


def test_the_groups_are_runconfigs_sections_in_order():
    titles = [title for title, _ in grouped_settings()]
    assert titles == [title for _, title in FLAG_GROUPS]
    assert all(fields for _, fields in grouped_settings())


def test_launch_help_lists_every_launcher_flag_with_its_help():
    own = flags.FLAGS.get_flags_for_module(launcher)
    text = launch_help(own, width=79)
    assert text.splitlines()[0] == "usage: python -m engine.launch [launcher flags] -- [engine.main flags]"
    entries, _ = _listed(text)
    assert entries == [flag.name for flag in own] and "evaluator" in entries
    assert max(len(line) for line in text.splitlines()) <= 79


def test_full_help_opens_with_usage_then_the_engines_flags_by_concern_then_absls():
    import engine.cli.config.flags  # noqa: F401  (the engine's flags, as engine.main defines them)

    text = full_help(flags.FLAGS, width=79)
    assert text.startswith(main_help(width=79).split("\nMost used flags:")[0])
    engine_part, libraries = text.split("\nThe libraries' flags", 1)
    entries, _ = _listed(engine_part)
    assert sorted(entries) == sorted(flag_settings())  # Every engine flag, once, each with its help.
    # In RunConfig's sections, each under its title, in order.
    flagged = set(flag_settings())
    in_sections = [field.name for _, fields in grouped_settings() for field in fields]
    assert entries == [name for name in in_sections if name in flagged]
    titles = [line[:-1] for line in engine_part.splitlines() if line.endswith(":") and not line.startswith(" ")]
    groups = [title for _, title in FLAG_GROUPS]
    assert [title for title in titles if title in groups] == groups
    absl_entries, _ = _listed(libraries)
    assert {"verbosity", "logtostderr", "flagfile", "undefok"} <= set(absl_entries)
    assert not set(absl_entries) & set(flag_settings())
    assert "Kept as small as this" not in text  # Not engine/main.py's docstring (absl's opening).
    assert str(REPO) not in text and "/engine/" not in text
    assert max(len(line) for line in text.splitlines()) <= 79
