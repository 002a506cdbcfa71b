"""The Trainer's option groups (`engine.options`): each a frozen dataclass that checks its
options and holds their help; the Trainer takes them as `step=`, `cadence=`, `checkpoint=`,
`spikes=`, `throughput=` (and, through a shim that warns, their options flat for one more
release); the command line builds the same groups from its settings, and its config files may
spell them grouped."""

import dataclasses
import inspect
import math
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf
import yaml
from helpers import (
    global_batches,
    loss_fn,
    main_in_process,
    make_arrays,
    make_model,
    one_error_line,
)

import engine
from engine.cli.config.settings import OPTIONS_WITHOUT_SETTINGS, RunConfig, setting_fields, trainer_options
from engine.errors import UserError
from engine.options import (
    FLAT_ALIASES,
    MAX_ROLLBACKS,
    NONFINITE_POLICIES,
    TRAINER_GROUPS,
    Cadence,
    CheckpointOptions,
    SpikeOptions,
    StepOptions,
    ThroughputOptions,
    group_options,
    options_from,
)
from engine.trainer import trainer as trainer_module

GROUP_FIELDS = [(group, field) for group in TRAINER_GROUPS.values() for field in dataclasses.fields(group)]
RUN_CONFIG_FIELDS = {field.name: field for field in setting_fields()}


def ids(item):
    return item.name if isinstance(item, dataclasses.Field) else getattr(item, "__name__", None)


# ------------------------------------------------------------------ the groups on their own


@pytest.mark.parametrize(("group", "field"), GROUP_FIELDS, ids=ids)
def test_every_option_has_its_help(group, field):
    assert field.metadata["help"].strip(), f"{group.__name__}.{field.name} has no help"
    assert "\n" not in field.metadata["help"]


def test_every_group_is_frozen_and_exported_from_engine():
    for keyword, group in TRAINER_GROUPS.items():
        assert getattr(engine, group.__name__) is group, keyword
        assert group.__name__ in engine.__all__
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group(), dataclasses.fields(group)[0].name, None)


@pytest.mark.parametrize(
    ("group", "options", "message"),
    [
        (StepOptions, {"clip_norm": 0.0}, "`clip_norm=0.0` must be positive and finite (None: no clipping)"),
        (
            StepOptions,
            {"clip_norm": math.nan},
            "`clip_norm=nan` must be positive and finite (None: no clipping)",
        ),
        (StepOptions, {"grad_accum_steps": 0}, "`grad_accum_steps=0` must be at least 1"),
        (
            StepOptions,
            {"on_nonfinite": "explode"},
            f"`on_nonfinite='explode'` must be one of: {', '.join(NONFINITE_POLICIES)}",
        ),
        (Cadence, {"steps_per_loop": 0}, "`steps_per_loop=0` must be at least 1"),
        (
            Cadence,
            {"eval_every": -1},
            "`eval_every=-1` must not be negative (None or 0: no evaluation during train())",
        ),
        (
            Cadence,
            {"checkpoint_every": -2},
            "`checkpoint_every=-2` must not be negative (None or 0: only at the end of train())",
        ),
        (Cadence, {"log_every": -1}, "`log_every=-1` must not be negative (0 logs after every loop)"),
        (Cadence, {"steps_per_epoch": 0}, "`steps_per_epoch=0` must be at least 1"),
        (CheckpointOptions, {"max_checkpoints": 0}, "`max_checkpoints=0` must be at least 1"),
        (SpikeOptions, {"max_loss": -1.0}, "`max_loss=-1.0` must be a positive, finite loss"),
        (SpikeOptions, {"max_loss": math.inf}, "`max_loss=inf` must be a positive, finite loss"),
        (SpikeOptions, {"rollback_skip_batches": -1}, "`rollback_skip_batches=-1` must be >= 0"),
        (SpikeOptions, {"max_rollbacks": 0}, "`max_rollbacks=0` must be at least 1"),
        (
            SpikeOptions,
            {"max_rollbacks": MAX_ROLLBACKS + 1},
            f"`max_rollbacks={MAX_ROLLBACKS + 1}` must be at most",
        ),
        (
            ThroughputOptions,
            {"flops_per_example": -1},
            "`flops_per_example=-1` must not be negative (None or 0: unknown)",
        ),
        (
            ThroughputOptions,
            {"peak_tflops": -1.0},
            "`peak_tflops=-1.0` must not be negative (None or 0: unknown)",
        ),
        (
            ThroughputOptions,
            {"peak_tflops": math.nan},
            "`peak_tflops=nan` must not be negative (None or 0: unknown)",
        ),
    ],
    ids=lambda item: item.__name__ if isinstance(item, type) else None,
)
def test_each_group_refuses_a_bad_option_in_one_line_naming_it(group, options, message):
    with pytest.raises(UserError) as raised:
        group(**options)
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_groups_take_their_good_values_and_keep_zero_as_never():
    assert StepOptions(clip_norm=1.0, grad_accum_steps=4, jit_compile=True, on_nonfinite="rollback")
    assert Cadence(eval_every=0, checkpoint_every=0, log_every=0) == Cadence()  # 0: never, as None.
    assert Cadence(steps_per_loop=1, eval_every=3).loop_length(0, 10) == 1
    assert CheckpointOptions(max_checkpoints=1, restore_dir="elsewhere", async_checkpoint=False)
    assert SpikeOptions(max_loss=10.0, rollback_skip_batches=0, max_rollbacks=MAX_ROLLBACKS)
    assert ThroughputOptions(flops_per_example=0, peak_tflops=0.0)  # Unknown, as the command line says it.
    assert SpikeOptions(max_loss=10.0).problem("skip").startswith("`max_loss=10.0` stops or rolls back")
    assert SpikeOptions(max_loss=10.0).problem("rollback") is None


def test_a_group_is_made_from_a_mapping_of_option_names():
    values = {"max_checkpoints": 7, "clip_norm": 2.0, "unrelated": object()}
    assert options_from(CheckpointOptions, values) == CheckpointOptions(max_checkpoints=7)
    assert options_from(StepOptions, values) == StepOptions(clip_norm=2.0)
    assert options_from(SpikeOptions, {}) == SpikeOptions()


def test_flat_aliases_become_their_groups_and_a_group_with_its_alias_is_refused():
    aliases = {"clip_norm", "steps_per_loop", "max_checkpoints"}
    grouped = group_options({"clip_norm": 1.0, "steps_per_loop": 5, "model": "m"}, aliases)
    assert grouped == {"model": "m", "step": StepOptions(clip_norm=1.0), "cadence": Cadence(steps_per_loop=5)}
    # Another group's alias beside a group is fine; a name that is no alias is left alone.
    mixed = group_options({"step": StepOptions(jit_compile=True), "max_checkpoints": 1, "log_every": 2}, aliases)
    assert mixed == {
        "step": StepOptions(jit_compile=True),
        "log_every": 2,
        "checkpoint": CheckpointOptions(max_checkpoints=1),
    }
    with pytest.raises(UserError, match=r"^`step=StepOptions\(\.\.\.\)` and its flat alias `clip_norm=1.0` "):
        group_options({"step": StepOptions(), "clip_norm": 1.0}, aliases)


# ------------------------------------------------------------------ the Trainer


def test_the_trainers_signature_is_the_groups_and_no_flat_option():
    parameters = inspect.signature(engine.Trainer).parameters
    for keyword in TRAINER_GROUPS:
        assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY and parameters[keyword].default is None
    assert len(parameters) == 20 and not FLAT_ALIASES & set(parameters)
    assert "steps_per_loop" not in str(inspect.signature(engine.Trainer.__init__))  # What help() shows.
    # The shim's names: the flat keywords of before the groups; an option added since has none.
    options = {field.name for _, field in GROUP_FIELDS}
    assert len(FLAT_ALIASES) == 19 and FLAT_ALIASES < options
    assert options - FLAT_ALIASES == {"straggler_margin", "straggler_loops"}
    for keyword, group in TRAINER_GROUPS.items():
        assert f"{keyword}: `engine.{group.__name__}(" in engine.Trainer.__doc__


def trainer_arguments(strategy) -> dict:
    """What `make_trainer` builds, for the tests of the flat shim: they call `engine.Trainer`
    itself, as `make_trainer` takes the groups only."""
    model, optimizer = make_model(strategy)
    return dict(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=global_batches(*make_arrays(64), 16),
        global_batch_size=16,
        loss_fn=loss_fn(),
    )


def test_the_flat_shim_trains_as_the_groups_and_warns_once_a_process_naming_them(default, monkeypatch, caplog):
    monkeypatch.setattr(trainer_module, "_FLAT_WARNED", set())  # As in a fresh process.
    told = (
        "Trainer's flat keywords are taken for one more release only: "
        "clip_norm= is step=engine.StepOptions(clip_norm=...); "
        "steps_per_loop= is cadence=engine.Cadence(steps_per_loop=...)"
    )
    with pytest.warns(DeprecationWarning) as first, caplog.at_level("WARNING", logger="engine"):
        flat = engine.Trainer(  # raw Trainer: the flat shim
            **trainer_arguments(default), steps_per_loop=3, clip_norm=1.0
        )
    assert [str(w.message) for w in first if "flat keywords" in str(w.message)] == [told]
    assert [r.getMessage() for r in caplog.records if "flat keywords" in r.getMessage()] == [told]
    assert flat.options.step == StepOptions(clip_norm=1.0) and flat.options.cadence == Cadence(steps_per_loop=3)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        flat_again = engine.Trainer(  # raw Trainer: the flat shim
            **trainer_arguments(default), steps_per_loop=3, clip_norm=1.0, max_loss=5.0
        )
    # Once each: only the flat keyword not seen before is told about.
    assert [str(w.message) for w in again if "flat keywords" in str(w.message)] == [
        "Trainer's flat keywords are taken for one more release only: "
        "max_loss= is spikes=engine.SpikeOptions(max_loss=...)"
    ]
    assert flat_again.options.step == flat.options.step
    assert flat_again.spike_options == SpikeOptions(max_loss=5.0)


def weights_and_trainer(strategy, model_dir, **options):
    arguments = trainer_arguments(strategy)
    trainer = engine.Trainer(**arguments, model_dir=str(model_dir), **options)  # raw Trainer: the flat shim
    trainer.train(7)
    trainer.close()
    return arguments["model"].get_weights(), trainer


FLAT = dict(
    clip_norm=0.05,
    grad_accum_steps=2,
    on_nonfinite="rollback",
    steps_per_loop=3,
    checkpoint_every=2,
    log_every=2,
    max_checkpoints=2,
    async_checkpoint=False,
    max_loss=1e6,
    rollback_skip_batches=1,
    flops_per_example=1000,
    peak_tflops=1.0,
)
GROUPED = dict(
    step=engine.StepOptions(clip_norm=0.05, grad_accum_steps=2, on_nonfinite="rollback"),
    cadence=engine.Cadence(steps_per_loop=3, checkpoint_every=2, log_every=2),
    checkpoint=engine.CheckpointOptions(max_checkpoints=2, async_checkpoint=False),
    spikes=engine.SpikeOptions(max_loss=1e6, rollback_skip_batches=1),
    throughput=engine.ThroughputOptions(flops_per_example=1000, peak_tflops=1.0),
)


def test_the_grouped_form_trains_to_exactly_the_flat_forms_weights(default, tmp_path):
    flat_weights, flat = weights_and_trainer(default, tmp_path / "flat", **FLAT)
    grouped_weights, grouped = weights_and_trainer(default, tmp_path / "grouped", **GROUPED)
    mixed = {key: value for key, value in GROUPED.items() if key != "checkpoint"}
    mixed_weights, _ = weights_and_trainer(
        default, tmp_path / "mixed", max_checkpoints=2, async_checkpoint=False, **mixed
    )
    plain_weights, _ = weights_and_trainer(default, tmp_path / "plain")
    for a, b, c in zip(flat_weights, grouped_weights, mixed_weights, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert not np.array_equal(flat_weights[0], plain_weights[0])  # The options did change the training.
    assert grouped.step_options == flat.step_options == grouped.options.step == GROUPED["step"]
    assert grouped.options.cadence is grouped.cadence and grouped.options.throughput == GROUPED["throughput"]
    assert isinstance(grouped.step, int) and isinstance(grouped.checkpoint, tf.train.Checkpoint)  # Not groups.
    assert grouped.cadence == flat.cadence == GROUPED["cadence"]
    assert grouped.spike_options == flat.spike_options == GROUPED["spikes"]
    assert grouped.checkpointer.options == flat.checkpointer.options == GROUPED["checkpoint"]
    assert sorted(p.name for p in (tmp_path / "flat" / "checkpoints").glob("ckpt-*.index")) == [
        "ckpt-6.index",
        "ckpt-7.index",
    ]
    assert sorted(p.name for p in (tmp_path / "grouped" / "checkpoints").glob("ckpt-*.index")) == [
        "ckpt-6.index",
        "ckpt-7.index",
    ]


@pytest.mark.parametrize(
    ("keyword", "alias", "value"),
    [
        ("step", "clip_norm", 1.0),
        ("step", "on_nonfinite", "stop"),  # Even at its default: given is given.
        ("cadence", "steps_per_loop", 5),
        ("cadence", "steps_per_epoch", 4),
        ("checkpoint", "max_checkpoints", 3),
        ("spikes", "max_loss", 5.0),
        ("throughput", "peak_tflops", 100.0),
    ],
)
def test_a_group_and_one_of_its_aliases_are_refused_in_one_line_naming_both(default, keyword, alias, value):
    arguments = trainer_arguments(default)
    with pytest.raises(UserError) as raised:
        engine.Trainer(  # raw Trainer: the flat shim
            **arguments, **{keyword: TRAINER_GROUPS[keyword](), alias: value}
        )
    message = str(raised.value)
    assert "\n" not in message
    assert (
        f"`{keyword}={TRAINER_GROUPS[keyword].__name__}(...)`" in message and f"`{alias}={value!r}`" in message
    )


def test_a_flat_alias_is_checked_by_its_group_and_an_unknown_keyword_is_still_a_type_error(default):
    arguments = trainer_arguments(default)
    with pytest.raises(UserError, match=r"^`steps_per_loop=0` must be at least 1$"):
        engine.Trainer(**arguments, steps_per_loop=0)  # raw Trainer: the flat shim
    with pytest.raises(UserError, match=r"^`steps_per_loop=0` must be at least 1$"):
        engine.Cadence(steps_per_loop=0)
    with pytest.raises(TypeError, match="steps_per_loops"):
        engine.Trainer(**arguments, steps_per_loops=5)  # raw Trainer: the signature's TypeError


# ------------------------------------------------------------------ the command line


def test_every_option_is_a_flag_or_listed_as_computed_by_the_job():
    for group, field in GROUP_FIELDS:
        if field.name in OPTIONS_WITHOUT_SETTINGS:
            assert field.name not in RUN_CONFIG_FIELDS, f"{field.name} is a setting: drop it from the list"
            continue
        assert field.name in RUN_CONFIG_FIELDS, (
            f"{group.__name__}.{field.name} has no setting: add it to RunConfig (its flag), or to "
            "OPTIONS_WITHOUT_SETTINGS saying why not"
        )
        assert RUN_CONFIG_FIELDS[field.name].metadata["flag"], field.name
    options = {field.name for _, field in GROUP_FIELDS}
    assert set(OPTIONS_WITHOUT_SETTINGS) <= options


def _another_value(field: dataclasses.Field):
    """A valid value of a RunConfig field other than its default, from its type and choices."""
    default = field.default
    if field.metadata["choices"]:
        return next(choice for choice in field.metadata["choices"] if choice != default)
    kind = str(field.type)
    if kind == "bool":
        return not default
    if default is None:
        return 7 if kind.startswith("int") else 7.5
    return default + 1 if kind == "int" else default + 1.5


def test_the_groups_the_command_line_passes_hold_every_setting_of_their_options():
    changed = {
        name: _another_value(RUN_CONFIG_FIELDS[name])
        for _, field in GROUP_FIELDS
        if (name := field.name) not in OPTIONS_WITHOUT_SETTINGS
    }
    computed = {"restore_dir": "chief_dir", "steps_per_epoch": 9, "flops_per_example": 123}
    groups = trainer_options(RunConfig(**changed), **computed)
    assert list(groups) == list(TRAINER_GROUPS)
    for keyword, group in TRAINER_GROUPS.items():
        assert type(groups[keyword]) is group
        for field in dataclasses.fields(group):
            expected = computed[field.name] if field.name in computed else changed[field.name]
            assert getattr(groups[keyword], field.name) == expected, field.name
    with pytest.raises(AssertionError, match="max_checkpoints"):
        trainer_options(RunConfig(), max_checkpoints=1)  # A setting comes from the config only.


# The settings whose command-line default differs from the option's; every other takes the option's.
OWN_DEFAULTS = {
    "eval_every": "the command line evaluates every 100 steps",
    "checkpoint_every": "and saves every 500",
    "log_every": "0 for None: a flag has no None",
    "peak_tflops": "0.0 for None: a flag has no None",
}


def test_a_setting_that_is_an_option_has_the_options_default():
    for _, field in GROUP_FIELDS:
        if field.name in OPTIONS_WITHOUT_SETTINGS or field.name in OWN_DEFAULTS:
            continue
        assert RUN_CONFIG_FIELDS[field.name].default == field.default, field.name
    assert trainer_options(RunConfig())["checkpoint"] == CheckpointOptions()
    assert trainer_options(RunConfig())["step"] == StepOptions()
    assert trainer_options(RunConfig())["spikes"] == SpikeOptions()


def test_flags_that_say_what_their_option_says_take_its_help():
    for name, group in (
        ("clip_norm", StepOptions),
        ("grad_accum_steps", StepOptions),
        ("jit_compile", StepOptions),
        ("max_checkpoints", CheckpointOptions),
        ("restore_fallback", CheckpointOptions),
        ("async_checkpoint", CheckpointOptions),
    ):
        assert RUN_CONFIG_FIELDS[name].metadata["help"] == engine.options.help_of(group, name)


def printed(*flags: str) -> dict:
    result = main_in_process(*flags, "--print_config")
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout)


@pytest.mark.cli
def test_a_config_file_may_write_the_options_grouped(tmp_path):
    path = tmp_path / "grouped.yaml"
    path.write_text(
        "model: mlp\n"
        "checkpoint: {max_checkpoints: 5, restore_fallback: true}\n"
        "cadence:\n  steps_per_loop: 7\n  eval_every: 0\n"
        "step: {clip_norm: 1.5}\n"
        "spikes: {max_rollbacks: 4}\n"
        "throughput: {peak_tflops: 9}\n"
    )
    settings = printed(f"--config_file={path}", "--max_checkpoints=6")  # A flag still wins.
    assert settings["max_checkpoints"] == 6 and settings["restore_fallback"] is True
    assert settings["steps_per_loop"] == 7 and settings["eval_every"] == 0
    assert settings["clip_norm"] == 1.5 and settings["max_rollbacks"] == 4 and settings["peak_tflops"] == 9.0
    assert not {"checkpoint", "cadence", "step", "spikes", "throughput"} & set(settings)  # Printed flat.


@pytest.mark.cli
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_checkpoints: 2\ncheckpoint: {max_checkpoints: 3}\n", "sets max_checkpoints twice"),
        ("checkpoint: {restore_dir: x}\n", "checkpoint.restore_dir is not an option of checkpoint that the"),
        ("checkpoint: 3\n", "checkpoint holds a int, not a mapping of its options; write e.g. checkpoint: {"),
        ("step: {clip_norm: big}\n", "clip_norm=big is not a number or null"),
    ],
)
def test_a_bad_grouped_option_in_a_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = one_error_line(main_in_process(f"--config_file={path}", "--print_config"))
    assert re.search(re.escape(message), line), line
