"""Library errors name the library's arguments, in backticks as Python code
(`restore_fallback=True`); the command line prints the same errors with its
flags (--restore_fallback), translated by `engine.cli.config.flag_names`.

Covers: engine/cli/config/flag_names.py.
"""

from pathlib import Path

import pytest
from helpers import (
    SMALL,
    main_in_process,
    one_error_line,
    small_trainer,
)

import engine
from engine.cli.config.flag_names import (
    QUALIFIED,
    RENAMED,
    FlagTermsFilter,
    errors_in_flag_terms,
    flag_names,
    in_flag_terms,
)
from engine.errors import NonFiniteLossError, UserError

# ------------------------------------------------------------------ the translation


@pytest.mark.parametrize(
    "library,command_line",
    [
        ("pass `restore_fallback=True` to restore", "pass --restore_fallback to restore"),
        ("`restore_fallback=False` keeps it", "--norestore_fallback keeps it"),
        ("or use a new `model_dir`", "or use a new --model_dir"),
        (
            "`collective_timeout=-1.0` must be >= 0 (0: no timeout)",
            "--collective_timeout=-1.0 must be >= 0 (0: no timeout)",
        ),
        ("`model_dir='/tmp/a b'` is in use", "--model_dir=/tmp/a b is in use"),
        ("`tpu='grpc://h:1'`: nothing answers", "--tpu=grpc://h:1: nothing answers"),
        ("`task_type='chief'` / `task_index=None`", "--task_type=chief / --task_index=None"),
        ("`worker_hosts=['a:1', 'b:2']`", "--worker_hosts=a:1,b:2"),
        ("`Trainer(clip_norm=1.0)`", "--clip_norm=1.0"),
        # Names the table maps: an argument called otherwise, a generic one qualified by its callable.
        ("unknown `schedule='linear'`", "unknown --lr_schedule=linear"),
        ("pass `BestCheckpoint(metric='loss')`", "pass --best_checkpoint_metric=loss"),
        ("`engine.hooks.ReduceLROnPlateau(metric)`", "--reduce_lr_metric"),
        ("`WeightHistograms(every=5)`", "--histogram_every=5"),
    ],
)
def test_library_arguments_become_flags(library, command_line):
    assert in_flag_terms(library) == command_line


@pytest.mark.parametrize(
    "text",
    [
        "is neither `local` nor grpc://HOST:PORT",  # a value, not a flag
        "run inside `srun`",
        "under `ulimit -n`",
        "try `python -m engine.launch --num_workers=2 --num_ps=1 -- ...`",
        "`metric='loss'` is not reported",  # generic: which flag depends on the hook
        "`BestCheckpoint` keeps it",  # a class, no argument
        "`Unknown(metric='loss')`",
        "`steps=5` of train()",  # an argument that backs no flag
        "`use_ema=True`",
        "no backticks at all: restore_fallback=True",
        "--already_a_flag=3 stays",
    ],
)
def test_other_backticked_text_is_left_alone(text):
    assert in_flag_terms(text) == text


def test_every_table_entry_names_a_flag():
    flags = flag_names()
    assert {"restore_fallback", "model_dir", "worker_hosts", "collective_timeout"} <= flags
    assert set(RENAMED.values()) <= flags and set(QUALIFIED.values()) <= flags
    assert not set(RENAMED) & flags  # A library name that is a flag already needs no entry.


def test_errors_in_flag_terms_keeps_the_exception():
    with pytest.raises(NonFiniteLossError, match="^set --clip_norm$"):
        with errors_in_flag_terms():
            raise NonFiniteLossError("set `clip_norm`")


def test_the_command_lines_log_lines_name_flags_too():
    import logging

    record = logging.LogRecord(
        "absl", logging.WARNING, "model_dir.py", 1, "`model_dir=%r` is not a local directory", ("ram://x",), None
    )
    assert FlagTermsFilter().filter(record)
    assert record.getMessage() == "--model_dir=ram://x is not a local directory"
    plain = logging.LogRecord("absl", logging.INFO, "x.py", 1, "step %d", (5,), None)
    assert FlagTermsFilter().filter(plain) and plain.getMessage() == "step 5"


# ------------------------------------------------------------------ the library's errors


def _zero_index(model_dir: Path, step: int) -> None:
    index = model_dir / "checkpoints" / f"ckpt-{step}.index"
    index.write_bytes(b"\0" * index.stat().st_size)


def test_trainer_restoring_an_unreadable_checkpoint_names_restore_fallback(tmp_path):
    small_trainer(tmp_path).train(4)  # ckpt-2, ckpt-4
    _zero_index(tmp_path, 4)
    with pytest.raises(UserError) as error:
        small_trainer(tmp_path)
    message = str(error.value)
    assert "ckpt-4 cannot be read" in message
    assert "pass `restore_fallback=True` to restore the newest older readable checkpoint" in message
    assert "or use a new `model_dir`" in message
    assert "--" not in message
    # What the message offers works.
    assert small_trainer(tmp_path, checkpoint=engine.CheckpointOptions(restore_fallback=True)).step == 2


def test_strategy_errors_name_build_strategys_arguments():
    with pytest.raises(UserError, match="^`cpu_devices=0` must be at least 1$"):
        engine.build_strategy("mirrored", cpu_devices=0)
    with pytest.raises(UserError, match="^unknown `strategy='mirrorred'`; choose one of: default"):
        engine.build_strategy("mirrorred")
    with pytest.raises(UserError) as error:
        engine.build_strategy("mirrored", num_gpus=64)
    assert "`num_gpus=64` but only" in str(error.value) and "--" not in str(error.value)


def test_multi_host_options_name_their_fields():
    from engine.cluster.multi_host import MultiHostOptions

    with pytest.raises(UserError, match=r"^`collective_timeout=-1` must be >= 0 \(0: no timeout\)$"):
        MultiHostOptions(collective_timeout=-1).check("multi_worker_mirrored")
    with pytest.raises(UserError, match="^`strategy='tpu'` needs `tpu='local'`"):
        MultiHostOptions().check("tpu")
    with pytest.raises(UserError, match="^unknown `communication='grpc'`"):
        MultiHostOptions(communication="grpc").check("multi_worker_mirrored")


def test_changed_settings_are_named_as_settings(tmp_path):
    from engine.checkpointing import checkpointer as checkpoint_lib

    small_trainer(tmp_path).train(2)
    checkpoint_lib.record_settings(str(tmp_path), {"optimizer": "adam"})
    with pytest.raises(UserError) as error:
        checkpoint_lib.check_settings(str(tmp_path), {"optimizer": "sgd"})
    message = str(error.value)
    assert message.startswith("`optimizer=sgd` differs from `optimizer=adam`")
    assert "pass `optimizer=adam` to resume, `reset_optimizer=True` to keep the weights" in message
    assert "--" not in message
    assert "--optimizer=sgd differs from --optimizer=adam" in in_flag_terms(message)
    assert "--reset_optimizer to keep the weights" in in_flag_terms(message)


# ------------------------------------------------------------------ the command line's


@pytest.mark.cli
def test_the_command_line_prints_the_same_error_with_its_flags(tmp_path):
    model_dir = tmp_path / "run"
    flags = [*SMALL, "--checkpoint_every=2", "--steps_per_loop=2", f"--model_dir={model_dir}"]
    trained = main_in_process(*flags, "--train_steps=4")
    assert trained.returncode == 0, trained.stderr[-3000:]
    _zero_index(model_dir, 4)
    line = one_error_line(main_in_process(*flags, "--train_steps=6"))
    assert "ckpt-4 cannot be read" in line
    assert "pass --restore_fallback to restore the newest older readable checkpoint" in line
    assert "or use a new --model_dir" in line
    assert "`" not in line
