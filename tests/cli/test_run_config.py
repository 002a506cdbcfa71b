"""`RunConfig` (`engine/cli/config/settings/`): composed of sections, each setting in one of them,
built and read by the flat names the flags and files use as well as by section.

Covers: engine/cli/config/settings/sections.py.
"""

import dataclasses

import pytest

from engine.cli.config.settings import SECTIONS, RunConfig, flag_settings, setting_fields
from engine.cli.config.settings.sections import ScheduleSettings, StateSettings
from engine.errors import UserError


def test_a_run_config_is_a_few_sections_each_setting_in_one():
    assert len(dataclasses.fields(RunConfig)) == len(SECTIONS) <= 16
    names = [field.name for field in setting_fields()]
    assert len(names) == len(set(names))  # No setting in two sections.
    assert not set(SECTIONS) & set(names)  # A section's name in a file is never a setting's.
    assert set(flag_settings()) <= set(names)
    for section in SECTIONS.values():
        assert dataclasses.is_dataclass(section) and section.__dataclass_params__.frozen
        assert all(field.metadata["help"] for field in dataclasses.fields(section))


def test_flat_names_and_sections_build_the_same_config():
    by_section = RunConfig(schedule=ScheduleSettings(train_steps=7), state=StateSettings(max_checkpoints=2))
    flat = RunConfig(train_steps=7, max_checkpoints=2)
    assert by_section == flat
    assert flat.schedule.train_steps == flat.train_steps == 7
    assert flat.settings()["max_checkpoints"] == 2
    assert list(flat.settings()) == [field.name for field in setting_fields()]
    moved = dataclasses.replace(flat, global_batch_size=8)  # A flat name over the copied sections.
    assert (moved.schedule.global_batch_size, moved.schedule.train_steps) == (8, 7)
    with pytest.raises(TypeError, match="no settings \\['train_step'\\]"):
        RunConfig(train_step=7)
    with pytest.raises(AttributeError, match="no setting 'train_step'"):
        _ = flat.train_step


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"global_batch_size": 0}, "--global_batch_size=0 must be at least 1"),  # The field's minimum.
        ({"optimizer": "adagrad"}, "unknown --optimizer='adagrad'; choose one of: sgd"),  # Its choices.
        ({"learning_rate": float("nan")}, "--learning_rate=nan must be a finite number"),  # Every number.
        ({"reduce_lr_metric": "loss", "lr_schedule": "cosine"}, "cannot be combined with --lr_schedule=cosine"),
        ({"on_nonfinite": "rollback", "strategy": "parameter_server"}, "--on_nonfinite=rollback is not"),
    ],
)
def test_validate_runs_each_sections_checks_then_those_across_sections(settings, message):
    with pytest.raises(UserError) as raised:
        RunConfig(**settings).validate()
    assert message in str(raised.value)
