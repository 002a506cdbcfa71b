"""Settings from files (`engine.cli.config.config_files`): `--config_file` (YAML, JSON), `--params_override`,
`task_params` and the `config.yaml` a training run keeps in its model_dir.

The precedence and each refusal are checked in-process on `--print_config` or a refused run
(nothing trains); one training run, then `--mode=eval`, `--mode=predict` and reruns on its
model_dir, checks that later commands need no flag repeated (slow: it trains for seconds).

Covers: engine/cli/config/config_files.py, engine/cli/config/small_files.py.
"""

import json
import os
import time

import numpy as np
import pytest
import yaml
from helpers import copy_of, in_background, main_in_process, one_error_line, snapshot

from engine.cli.config.config_files import parse_overrides
from engine.cli.config.settings import CLUSTER_SETTINGS, MODEL_AND_DATA_SETTINGS, PER_INVOCATION_SETTINGS
from engine.errors import UserError

TINY = {"train_steps": 4, "eval_every": 0, "steps_per_loop": 2, "global_batch_size": 32}


def printed(*flags: str) -> dict:
    """The settings `--print_config` prints for `flags`, read back as YAML."""
    result = main_in_process(*flags, "--print_config")
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout)


def refused(*flags: str) -> str:
    """The one error line of a command that must be refused with exit status 2."""
    return one_error_line(main_in_process(*flags))


def stored(model_dir, **settings) -> None:
    """A model_dir holding `config.yaml` with `settings`, as a training run leaves it."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.yaml").write_text(yaml.safe_dump(settings))


def with_a_checkpoint(model_dir) -> None:
    """What `check_model_and_data` looks for: a checkpoint's index file (its content is not read)."""
    (model_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (model_dir / "checkpoints" / "ckpt-4.index").write_bytes(b"")


def test_the_named_tuples_of_settings():
    assert set(CLUSTER_SETTINGS) <= set(PER_INVOCATION_SETTINGS)
    assert {"mode", "config_file", "params_override", "model_dir", "export_dir"} <= set(PER_INVOCATION_SETTINGS)
    assert {"task", "task_params", "model", "dataset", "loss", "label_column"} <= set(MODEL_AND_DATA_SETTINGS)
    assert not {"data_dir", "eval_file"} & set(MODEL_AND_DATA_SETTINGS)  # Data sets get moved.
    assert not set(MODEL_AND_DATA_SETTINGS) & set(PER_INVOCATION_SETTINGS)


# ------------------------------------------------------------------ precedence and types


def test_column_types_are_a_mapping_or_a_list_in_a_config_file(tmp_path):
    """`column_types: {zip: category, id: drop}` is what `--column_types=zip:category,id:drop` says."""
    table = "dataset: t.csv\nlabel_column: y\n"
    (tmp_path / "a.yaml").write_text(table + "column_types: {zip: category, id: drop}\n")
    (tmp_path / "b.yaml").write_text(table + "column_types: [zip:category, id:drop]\n")
    flags = ("--dataset=t.csv", "--label_column=y", "--column_types=zip:category,id:drop")
    expected = printed(*flags)["column_types"]
    assert expected == ["zip:category", "id:drop"]
    for name in ("a.yaml", "b.yaml"):
        assert printed(f"--config_file={tmp_path / name}")["column_types"] == expected
    (tmp_path / "c.yaml").write_text(table + "column_types: {zip: [1]}\n")
    assert "write column_types: {zip: category, id: drop}" in refused(f"--config_file={tmp_path / 'c.yaml'}")


@pytest.mark.cli
def test_precedence_file_then_later_file_then_override_then_flag(tmp_path):
    first = tmp_path / "first.yaml"
    first.write_text(  # --print_config imports the task (any callable taking keywords), never calls it.
        "model: mlp\nlearning_rate: 0.1\nglobal_batch_size: 32\nseed: 1\neval_every: 1\ntrain_steps: 3\n"
        "task: builtins:dict\ntask_params:\n  units: 16\n  depth: 2\n"
    )
    second = tmp_path / "second.json"  # JSON, by its name.
    second.write_text(json.dumps({"learning_rate": 0.2, "global_batch_size": 16, "seed": 2, "eval_every": 2}))
    settings = printed(
        f"--config_file={first}",
        f"--config_file={second}",
        "--params_override=seed=3,eval_every=3,task_params.units=64",
        "--eval_every=4",
    )
    assert settings["train_steps"] == 3 and settings["model"] == "mlp"  # the first file alone
    assert settings["learning_rate"] == 0.2 and settings["global_batch_size"] == 16  # the later file wins
    assert settings["seed"] == 3  # the override wins over the files
    assert settings["eval_every"] == 4  # a flag wins over everything
    assert settings["task_params"] == {"units": 64, "depth": 2}  # a dotted override merges into the mapping
    assert settings["optimizer"] == "adam"  # defaults where nothing sets a value


@pytest.mark.cli
def test_a_flag_in_a_flagfile_wins_and_an_absent_flag_hides_nothing(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.1\ntrain_steps: 9\n")
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--learning_rate=0.5\n")
    settings = printed(f"--config_file={config}", f"--flagfile={flagfile}")
    assert (settings["learning_rate"], settings["train_steps"]) == (0.5, 9)


@pytest.mark.cli
def test_printed_config_reads_back_as_the_same_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: mlp\nlearning_rate: 3e-3\nprofile_steps: '2,4'\ntask: builtins:dict\ntask_params: {units: 8}\n"
    )
    first = main_in_process(f"--config_file={config}", "--train_steps=5", "--print_config")
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "printed.yaml").write_text(first.stdout)
    again = main_in_process(f"--config_file={tmp_path / 'printed.yaml'}", "--print_config")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == first.stdout
    assert yaml.safe_load(first.stdout)["learning_rate"] == 0.003  # PyYAML's string '3e-3', typed


def test_override_values_are_typed_as_their_settings():
    values = parse_overrides(
        "train_steps=3,learning_rate=1e-3,clip_norm=3,deterministic=true,worker_hosts=[h:1,h:2],"
        "ps_hosts=h:3;h:4,profile_steps='100,110',data_dir=2024,tpu=null,"
        "task_params.encoder.depth=2,task_params.sizes=[1, 2],task_params.name=wide"
    ).values
    assert values["train_steps"] == 3 and isinstance(values["train_steps"], int)
    assert (
        values["learning_rate"] == 0.001
        and values["clip_norm"] == 3.0
        and isinstance(values["clip_norm"], float)
    )
    assert values["deterministic"] is True
    assert values["worker_hosts"] == ["h:1", "h:2"] and values["ps_hosts"] == ["h:3", "h:4"]
    assert values["profile_steps"] == "100,110"  # commas inside quotes do not split
    assert values["data_dir"] == "2024"  # a string setting takes the text
    assert values["tpu"] is None
    assert values["task_params"] == {"encoder": {"depth": 2}, "sizes": [1, 2], "name": "wide"}


@pytest.mark.cli
def test_a_config_file_may_write_the_settings_under_their_sections(tmp_path):
    """RunConfig's sections are a second spelling of the same settings: a file and an override
    may use them, --print_config (and config.yaml) keep the flat names, a flag still wins."""
    path = tmp_path / "sections.yaml"
    path.write_text(
        "problem: {model: mlp, eval_fraction: 0.2}\n"
        "schedule:\n  global_batch_size: 16\n  train_steps: 9\n"
        "state: {max_checkpoints: 4}\n"
        "spikes: {on_nonfinite: skip}\n"
        "seed: 7\n"
    )
    settings = printed(f"--config_file={path}", "--params_override=optimization.learning_rate=0.02", "--seed=8")
    assert (settings["model"], settings["eval_fraction"], settings["global_batch_size"]) == ("mlp", 0.2, 16)
    assert (settings["train_steps"], settings["max_checkpoints"], settings["on_nonfinite"]) == (9, 4, "skip")
    assert settings["learning_rate"] == 0.02 and settings["seed"] == 8
    assert not {"problem", "schedule", "state", "spikes", "optimization"} & set(settings)  # Printed flat.


@pytest.mark.cli
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed: 1\nnumerics: {seed: 2}\n", "sets seed twice, as seed and as numerics.seed; keep one"),
        ("schedule: {model: mlp}\n", "schedule.model is not an option of schedule"),
        ("state: [model_dir]\n", "state holds a list, not a mapping of its options; write e.g. state: {"),
    ],
)
def test_a_bad_section_in_a_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert message in refused(f"--config_file={path}", "--print_config")


@pytest.mark.parametrize(
    "override, named",
    [
        ("learning_rate=fast", "learning_rate=fast is not a number"),
        ("train_steps=2.5", "train_steps=2.5 is not an integer"),
        ("deterministic=3", "deterministic=3 is not true or false"),
        ("worker_hosts=[1,2]", "worker_hosts=[1, 2] is not a list of strings"),
        ("learning_rate", "'learning_rate' is not NAME=VALUE"),
        ("lerning_rate=1", "unknown setting 'lerning_rate' (did you mean learning_rate"),
        ("model.depth=1", "model is not a mapping"),
        ("task_params.a=[1", "an unclosed bracket"),
        ("config_file=x.yaml", "config_file cannot be overridden"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(override, named):
    with pytest.raises(UserError, match="--params_override") as raised:
        parse_overrides(override)
    assert named in str(raised.value)


@pytest.mark.cli
def test_task_params_without_a_task_are_refused_naming_where_they_are_set(tmp_path):
    model_dir = tmp_path / "run"
    line = refused("--model=mlp", "--params_override=task_params.units=64", f"--model_dir={model_dir}")
    assert line == (
        "engine.main: error: --params_override=task_params={units: 64} sets keyword arguments of a --task "
        "function, but no --task is given; pass --task=package.module:function, or drop task_params from "
        "--params_override"
    )
    config = tmp_path / "run.yaml"
    config.write_text("task_params: {units: 64}\n")
    line = refused(f"--config_file={config}", f"--model_dir={model_dir}")
    assert line.endswith(f"pass --task=package.module:function, or remove task_params from {config}")
    assert not model_dir.exists()


@pytest.mark.cli
def test_train_steps_and_epochs_are_alternatives_across_layers(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train_steps: 40\n")
    settings = printed(f"--config_file={config}", "--epochs=2")
    assert (settings["train_steps"], settings["epochs"]) == (None, 2.0)


# ------------------------------------------------------------------ bad files: one line, nothing written


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)
BAD_FILES = {
    "unknown.yaml": ("modle: mlp\n", "unknown setting 'modle'"),
    "type.json": ('{"train_steps": "many"}', "train_steps=many is not an integer"),
    "damaged.yaml": ("model: [mlp\n", "is not valid YAML (line 2"),
    "damaged.json": ('{"model": "mlp",}', "is not valid JSON"),
    "list.yaml": ("- model\n- mlp\n", "holds a list, not a mapping"),
    "twice.yaml": ("model: mlp\nmodel: cnn\n", "'model' is set twice"),
    "binary.yaml": (b"model: \xff\n", "is not a text file"),
    "cli.yaml": ("print_config: true\n", "print_config is a setting of the command line only"),
    # Nine aliases of nine aliases, nine deep: 9**9 values expanded from under 1 KB (it hung).
    "bomb.yaml": (ALIAS_BOMB, "holds more than 10000 values (aliases expanded)"),
    "deep.yaml": (
        "task_params: " + "[" * 20_000 + "]" * 20_000 + "\n",
        "nests lists or mappings more than 50 deep",
    ),
    "deep.json": ("[" * 20_000 + "]" * 20_000, "nests lists or mappings more than 50 deep"),
    "loop.yaml": ("task_params: &a {a: *a}\n", "alias *a is inside the node &a it names"),
    "huge.yaml": ("#" * 2**20 + "\n", f"is {2**20 + 1} bytes, more than the {2**20} bytes"),
}


@pytest.mark.cli
@pytest.mark.parametrize("name", [*BAD_FILES, "missing.yaml"])
def test_a_bad_config_file_is_one_line_naming_it_and_nothing_is_written(tmp_path, name):
    path = tmp_path / name
    if name in BAD_FILES:
        content, _ = BAD_FILES[name]
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    model_dir = tmp_path / "run"
    started = time.monotonic()
    line = refused(f"--config_file={path}", f"--model_dir={model_dir}", "--train_steps=4")
    assert f"--config_file={path}" in line
    assert (BAD_FILES[name][1] if name in BAD_FILES else "does not exist") in line
    assert not model_dir.exists()
    assert time.monotonic() - started < 20  # Refused at once: nothing expanded, nothing hung.


def not_blocked_by(fifo, *flags: str):
    """`main_in_process(*flags)` in a thread, given 30 s: a command that blocks on `fifo` fails the
    test instead of hanging it, and a writer then lets the blocked open go."""
    future = in_background(main_in_process, *flags)
    try:
        return future.result(timeout=30)
    finally:
        if not future.done():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.cli
def test_a_fifo_as_a_config_file_or_the_stored_config_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "settings.yaml"
    os.mkfifo(fifo)
    model_dir = tmp_path / "run"
    line = one_error_line(
        not_blocked_by(fifo, f"--config_file={fifo}", f"--model_dir={model_dir}", "--print_config")
    )
    assert line == (
        f"engine.main: error: --config_file={fifo} is a FIFO (named pipe), not a regular file; "
        "pass a readable YAML or JSON file"
    )
    model_dir.mkdir()
    os.mkfifo(model_dir / "config.yaml")
    for mode in ("eval", "train"):
        line = one_error_line(
            not_blocked_by(model_dir / "config.yaml", f"--mode={mode}", f"--model_dir={model_dir}")
        )
        assert f"{model_dir}/config.yaml is a FIFO (named pipe), not a regular file" in line
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.yaml"]


@pytest.mark.cli
@pytest.mark.parametrize("name", ["metrics.json", "checkpoints/checkpoint", "best/best.json"])
def test_a_fifo_among_the_files_a_command_reads_in_a_model_dir_is_one_line_not_a_hang(tmp_path, name):
    model_dir = tmp_path / "run"
    stored(model_dir, model="mlp")
    with_a_checkpoint(model_dir)
    fifo = model_dir / name
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    for mode in ("eval", "train"):
        line = one_error_line(not_blocked_by(fifo, f"--mode={mode}", f"--model_dir={model_dir}"))
        assert (
            f"{fifo} is a FIFO (named pipe), not a regular file: a command reads the model_dir's files" in line
        )


@pytest.mark.cli
def test_a_flagfile_that_is_a_fifo_or_a_device_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "run.flags"
    os.mkfifo(fifo)
    line = one_error_line(not_blocked_by(fifo, f"--flagfile={fifo}", "--print_config"))
    assert (
        f"--flagfile={fifo} is a FIFO (named pipe), not a regular file; write the flags to a regular file"
        in line
    )
    line = one_error_line(main_in_process("--flagfile=/dev/zero", "--print_config"))  # Endless: read until OOM.
    assert "--flagfile=/dev/zero is a character device, not a regular file" in line
    read, write = os.pipe()  # What the shell passes for --flagfile=<(echo --seed=7): absl reads it.
    os.write(write, b"--seed=7\n")
    os.close(write)
    try:
        assert printed(f"--flagfile=/dev/fd/{read}")["seed"] == 7
    finally:
        os.close(read)
    big = tmp_path / "big.flags"
    big.write_text("--seed=1\n" * 2**17)
    assert "more than the 1048576 bytes" in one_error_line(
        main_in_process(f"--flagfile={big}", "--print_config")
    )


@pytest.mark.cli
def test_a_bad_override_on_the_command_line_writes_nothing(tmp_path):
    model_dir = tmp_path / "run"
    line = refused("--params_override=train_steps=many", f"--model_dir={model_dir}")
    expected = "--params_override: train_steps=many is not an integer or null; pass train_steps=10"
    assert line == f"engine.main: error: {expected}"
    assert not model_dir.exists()


# ------------------------------------------------------------------ the stored config.yaml


@pytest.mark.cli
def test_the_stored_config_is_inherited_but_not_per_invocation_settings(tmp_path):
    model_dir = tmp_path / "run"
    stored(model_dir, model="mlp", learning_rate=0.05, train_steps=4, mode="eval", export_dir="x", seed=5)
    settings = printed(f"--model_dir={model_dir}", "--seed=6")
    assert (settings["model"], settings["learning_rate"], settings["train_steps"]) == ("mlp", 0.05, 4)
    assert settings["seed"] == 6  # a flag wins over it
    assert (settings["mode"], settings["export_dir"]) == ("train_and_eval", None)  # never inherited


@pytest.mark.cli
def test_a_run_trained_before_normalize_existed_keeps_its_columns_and_its_length(tmp_path):
    """Its checkpoints hold no standardization layers: the new default would not restore them; and
    a finished run of the default length stays finished (the floor of 500 steps came with it)."""
    old, new = tmp_path / "old", tmp_path / "new"
    stored(old, model="mlp", dataset="t.csv", label_column="y")
    stored(new, model="mlp", dataset="t.csv", label_column="y", normalize="standardize")
    assert printed(f"--model_dir={old}")["normalize"] == "none"
    assert printed(f"--model_dir={old}")["epochs"] == 20  # Its length: 20 epochs, without the 500-step floor.
    assert printed(f"--model_dir={old}", "--train_steps=7")["epochs"] is None  # A length given wins.
    assert printed(f"--model_dir={new}")["normalize"] == "standardize"
    assert printed(f"--model_dir={new}")["epochs"] is None
    assert printed(f"--model_dir={tmp_path / 'fresh'}", "--dataset=t.csv")["normalize"] == "standardize"
    with_a_checkpoint(old)
    line = refused(f"--model_dir={old}", "--normalize=standardize")
    assert "--normalize=standardize differs from normalize=none" in line, line


@pytest.mark.cli
def test_a_reader_mode_does_not_inherit_a_strategy_that_needs_a_cluster(tmp_path):
    model_dir = tmp_path / "run"
    stored(model_dir, model="mlp", strategy="parameter_server")
    settings = printed("--mode=eval", f"--model_dir={model_dir}")
    assert (settings["model"], settings["strategy"]) == ("mlp", "default")


@pytest.mark.cli
def test_model_and_data_may_change_until_there_is_a_checkpoint(tmp_path):
    model_dir = tmp_path / "run"
    stored(model_dir, model="mlp", task_params={"units": 8})
    assert printed("--model=cnn", f"--model_dir={model_dir}")["model"] == "cnn"
    with_a_checkpoint(model_dir)
    before = snapshot(model_dir)
    line = refused("--model=cnn", f"--model_dir={model_dir}", "--print_config")
    assert line == (
        f"engine.main: error: --model=cnn differs from model=mlp that {model_dir}/config.yaml was trained "
        "with; use a new --model_dir, or drop --model"
    )
    config = tmp_path / "other.yaml"
    config.write_text("task_params: {units: 16}\n")
    line = refused(f"--config_file={config}", f"--model_dir={model_dir}")
    assert f"task_params={{units: 16}} in {config} differs from task_params={{units: 8}}" in line
    assert f"remove task_params from {config}" in line
    assert snapshot(model_dir) == before


@pytest.mark.cli
@pytest.mark.parametrize(
    "content, named",
    [
        ("model: [mlp\n", "is damaged"),
        ("", "is damaged: not a mapping"),
        ("train_steps: many\n", "train_steps=many is not an integer"),
        ("modle: mlp\n", "unknown setting 'modle'"),
        pytest.param(ALIAS_BOMB, "holds more than 10000 values (aliases expanded)", id="alias_bomb"),
    ],
)
def test_a_damaged_stored_config_is_one_line_naming_it_and_nothing_is_written(tmp_path, content, named):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "config.yaml").write_text(content)
    for mode in ("train", "eval"):
        line = refused(f"--mode={mode}", f"--model_dir={model_dir}", "--train_steps=4")
        assert f"{model_dir}/config.yaml" in line and named in line
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.yaml"]


def test_stored_settings_keep_the_task_and_its_params_but_not_per_invocation_ones():
    from engine.cli.config.config_files import stored_settings
    from engine.cli.config.settings import RunConfig

    config = RunConfig(task="my_tasks:build", task_params={"units": 8, "encoder": {"depth": 2}}, mode="eval")
    settings = stored_settings(config)
    assert settings["task"] == "my_tasks:build" and settings["task_params"] == {
        "units": 8,
        "encoder": {"depth": 2},
    }
    assert not set(settings) & set(PER_INVOCATION_SETTINGS)


# ------------------------------------------------------------------ code a model_dir names (docs/security.md)


EVIL = "import pathlib\npathlib.Path('imported').write_text('x')\n\ndef run(**kwargs):\n    pass\n"


@pytest.mark.cli
@pytest.mark.parametrize("mode", ["eval", "predict", "train", "print_config"])
def test_code_named_by_a_model_dir_alone_is_refused_before_it_is_imported(tmp_path, mode):
    (tmp_path / "evil.py").write_text(EVIL)  # Importable where the command runs, as a user's module is.
    model_dir = tmp_path / "given"
    stored(model_dir, task="subprocess:run", task_params={"args": "touch pwned", "shell": True})
    with_a_checkpoint(model_dir)
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 4), np.float32))
    flags = {
        "eval": ["--mode=eval"],
        "predict": ["--mode=predict", f"--predict_input={tmp_path / 'x.npz'}", "--predict_output=out.npy"],
        "train": ["--train_steps=8"],
        "print_config": ["--print_config"],
    }[mode]
    before = snapshot(model_dir)
    result = main_in_process(*flags, f"--model_dir={model_dir}", cwd=tmp_path)
    assert one_error_line(result) == (
        f"engine.main: error: task=subprocess:run in {model_dir}/config.yaml names code to run, and a model_dir "
        "cannot choose that for you (docs/security.md); pass --task=subprocess:run to trust it"
    )
    for name, value in (("model", "evil:run"), ("dataset", "evil:run")):
        stored(model_dir, **{name: value})
        line = one_error_line(main_in_process(*flags, f"--model_dir={model_dir}", cwd=tmp_path))
        assert f"{name}={value} in {model_dir}/config.yaml names code to run" in line
        assert line.endswith(f"pass --{name}={value} to trust it")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "imported").exists()
    assert not (tmp_path / "out.npy").exists()
    stored(model_dir, task="subprocess:run", task_params={"args": "touch pwned", "shell": True})
    assert snapshot(model_dir) == before


@pytest.mark.cli
def test_code_a_model_dir_names_is_used_when_the_command_names_it_too(tmp_path):
    model_dir = tmp_path / "run"
    stored(model_dir, model="builtins:print", dataset="digits", learning_rate=0.5)
    with_a_checkpoint(model_dir)
    assert printed(f"--model_dir={model_dir}", "--model=builtins:print")["learning_rate"] == 0.5
    config = tmp_path / "mine.yaml"  # Or in a config file the user passes, or an override.
    config.write_text("model: builtins:print\n")
    assert printed(f"--model_dir={model_dir}", f"--config_file={config}")["model"] == "builtins:print"
    assert (
        printed(f"--model_dir={model_dir}", "--params_override=model=builtins:print")["model"]
        == "builtins:print"
    )
    # Built-in names, files and tfds sets are data: a model_dir's own are used as they are.
    stored(model_dir, model="mlp", dataset="tfds:mnist")
    assert printed(f"--model_dir={model_dir}")["dataset"] == "tfds:mnist"


@pytest.mark.cli
def test_a_tpu_address_a_model_dir_names_is_refused_and_readers_drop_it(tmp_path):
    model_dir = tmp_path / "run"
    stored(model_dir, model="mlp", strategy="tpu", tpu="grpc://10.1.2.3:8470")
    line = refused(f"--model_dir={model_dir}", "--print_config")
    assert "tpu=grpc://10.1.2.3:8470 in" in line and "names a machine to send the model and data to" in line
    assert line.endswith("pass --tpu=grpc://10.1.2.3:8470 to trust it")
    settings = printed("--mode=eval", f"--model_dir={model_dir}")  # Evaluates on this host: no TPU.
    assert (settings["strategy"], settings["tpu"]) == ("default", None)


# ------------------------------------------------------------------ end to end: train, then --model_dir alone


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir trained with `--model=mlp --config_file=...` (and an export) by engine.main."""
    root = tmp_path_factory.mktemp("config")
    config = root / "mlp.yaml"
    config.write_text(yaml.safe_dump({**TINY, "learning_rate": 0.01}))
    model_dir = root / "run"
    result = main_in_process(
        "--model=mlp", f"--config_file={config}", f"--model_dir={model_dir}", f"--export_dir={root / 'export'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir


@pytest.mark.cli
@pytest.mark.slow
def test_the_training_keeps_its_resolved_settings_in_config_yaml(trained):
    settings = yaml.safe_load((trained / "config.yaml").read_text())
    assert settings["model"] == "mlp" and settings["learning_rate"] == 0.01 and settings["train_steps"] == 4
    assert settings["task_params"] == {}  # A --task's keyword arguments are kept: test_stored_settings_...
    assert not set(settings) & set(PER_INVOCATION_SETTINGS)  # export_dir, mode, model_dir, ... left out
    assert not [p.name for p in trained.iterdir() if ".tmp" in p.name]  # written by a rename


@pytest.mark.cli
@pytest.mark.slow
def test_eval_with_only_the_model_dir_gives_the_training_s_final_loss(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    config_before = (model_dir / "config.yaml").read_bytes()
    final = json.loads((model_dir / "metrics.json").read_text())["eval"]
    result = main_in_process("--mode=eval", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    evaluations = json.loads((model_dir / "metrics.json").read_text())["evaluations"]
    assert evaluations[-1]["mode"] == "eval"
    assert evaluations[-1]["eval"]["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert (model_dir / "config.yaml").read_bytes() == config_before  # eval only reads it


@pytest.mark.cli
@pytest.mark.slow
def test_predict_with_only_the_model_dir_and_its_files(trained, tmp_path):
    before = snapshot(trained)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).random((3, 28, 28, 1), dtype=np.float32))
    result = main_in_process(
        "--mode=predict",
        f"--model_dir={trained}",
        f"--predict_input={tmp_path / 'x.npz'}",
        f"--predict_output={tmp_path / 'out.npy'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.load(tmp_path / "out.npy").shape == (3, 10)
    assert snapshot(trained) == before


@pytest.mark.cli
@pytest.mark.slow
def test_a_resume_refuses_another_model_and_takes_new_other_settings(trained, tmp_path):
    model_dir = copy_of(trained, tmp_path / "run")
    before, export = snapshot(model_dir), snapshot(trained.parent / "export")
    line = refused("--model=cnn", f"--model_dir={model_dir}")
    assert "--model=cnn differs from model=mlp" in line and f"{model_dir}/config.yaml" in line
    assert snapshot(model_dir) == before  # byte for byte
    # The same command with fewer flags: the stored settings, the new ones over them.
    result = main_in_process(f"--model_dir={model_dir}", "--train_steps=6", "--learning_rate=0.02")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model=mlp" in result.stderr and "steps=4->6" in result.stderr
    settings = yaml.safe_load((model_dir / "config.yaml").read_text())
    assert (settings["train_steps"], settings["learning_rate"], settings["model"]) == (6, 0.02, "mlp")
    assert "export_dir" not in settings
    assert snapshot(trained.parent / "export") == export  # --export_dir was the training's alone
