"""A model_dir writes only inside itself (docs/security.md): records are written through a
temporary created exclusively, never through a symbolic link; a link where the engine writes
is refused in one line before anything is written; an export goes into a directory of its own."""

import os
import stat
from pathlib import Path

import pytest
import tensorflow as tf

from engine import model_dir as model_dir_lib
from engine.cli.config.config_files import STORED_CONFIG
from engine.cli.run.inputs_record import INPUTS_FILE
from engine.cli.run.run_record import METRICS_FILE
from engine.diagnostics import DIAGNOSTICS_DIR
from engine.errors import UserError, printable
from engine.export import check_export_dir


def plant_temporary_links(directory: Path, name: str, target: Path) -> None:
    """`<name>.tmp<pid>` links to `target` for the pids the old writer could have used: the first
    thousands, this process's, and those around it (a child's)."""
    pids = {*range(1, 4097), *range(os.getpid() - 64, os.getpid() + 4097)}
    for pid in pids:
        (directory / f"{name}.tmp{pid}").symlink_to(target)


def test_a_record_is_never_written_through_planted_temporary_links(tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("the user's own file\n")
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    plant_temporary_links(model_dir, METRICS_FILE, victim)
    model_dir_lib.write_json(str(model_dir / METRICS_FILE), {"global_step": 3})
    assert victim.read_text() == "the user's own file\n"
    written = model_dir / METRICS_FILE
    assert not written.is_symlink() and written.read_text() == '{\n  "global_step": 3\n}'
    (tmp_path / "reference").write_text("")  # What `open` makes under this umask (not mkstemp's 0600).
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE((tmp_path / "reference").stat().st_mode)
    assert not [p.name for p in model_dir.iterdir() if not p.is_symlink() and p.name != METRICS_FILE]


def test_a_record_that_is_a_link_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    (tmp_path / "run").mkdir()
    record = tmp_path / "run" / "best.json"
    record.symlink_to(victim)
    model_dir_lib.write_atomically(str(record), b"new")
    assert victim.read_text() == "{}" and not record.is_symlink() and record.read_bytes() == b"new"


def test_a_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        model_dir_lib.write_atomically(str(tmp_path / "metrics.json"), "{}")
    assert list(tmp_path.iterdir()) == []


def test_remote_file_systems_are_written_as_before():
    path = "ram://model_dir_writes/run/metrics.json"
    model_dir_lib.write_json(path, {"global_step": 1})
    model_dir_lib.write_json(path, {"global_step": 2})
    assert model_dir_lib.read_json(path, what="the record") == {"global_step": 2}
    assert tf.io.gfile.listdir("ram://model_dir_writes/run") == ["metrics.json"]


@pytest.mark.parametrize("name", [*model_dir_lib.SUBDIRECTORIES, *model_dir_lib.RECORD_FILES])
def test_a_link_where_the_engine_writes_is_refused_naming_it(tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "checkpoint").write_text("someone's")
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    target = elsewhere if name in model_dir_lib.SUBDIRECTORIES else elsewhere / "checkpoint"
    (model_dir / name).symlink_to(target)
    with pytest.raises(UserError) as raised:
        model_dir_lib.check_kinds(str(model_dir))
    message = str(raised.value)
    assert "\n" not in message and f"{model_dir / name} is a symbolic link (to {elsewhere}" in message, message
    assert "nothing was written through it" in message


def test_a_link_deeper_in_the_engines_directories_is_refused(tmp_path):
    """TensorFlow writes `ckpt-N_temp/part-...` and renames: a planted link there is followed."""
    model_dir = tmp_path / "run"
    (model_dir / "checkpoints" / "ckpt-5_temp").mkdir(parents=True)
    (model_dir / "checkpoints" / "ckpt-5_temp" / "part-00000-of-00001").symlink_to(tmp_path)
    with pytest.raises(UserError, match="ckpt-5_temp/part-00000-of-00001 is a symbolic link"):
        model_dir_lib.check_kinds(str(model_dir))


def test_a_model_dir_that_is_itself_a_link_and_links_elsewhere_in_it_are_fine(tmp_path):
    """The model_dir's own path is the user's choice; files the engine never writes are not its."""
    real = tmp_path / "run-5"
    (real / "checkpoints").mkdir(parents=True)
    (real / "data").symlink_to(tmp_path)
    (tmp_path / "latest").symlink_to(real)
    model_dir_lib.check_kinds(str(tmp_path / "latest"))


def test_the_record_names_are_the_records_modules_names():
    assert set(model_dir_lib.RECORD_FILES) == {METRICS_FILE, STORED_CONFIG, INPUTS_FILE}
    assert DIAGNOSTICS_DIR in model_dir_lib.SUBDIRECTORIES


def test_printable_escapes_what_would_act_on_a_terminal():
    assert printable("loss\x1b[31m\r\nengine.main: error: x\u202e\t") == (
        "loss\\x1b[31m\\r\\nengine.main: error: x\\u202e\\t"
    )
    assert printable("accuracy é 0.97 [x]") == "accuracy é 0.97 [x]"


def test_an_export_dir_is_refused_among_other_files_or_inside_the_models_own(tmp_path):
    model_dir = tmp_path / "run"
    (model_dir / "checkpoints").mkdir(parents=True)
    for inside in (model_dir, model_dir / "checkpoints", model_dir / "best" / "export"):
        with pytest.raises(UserError, match=r"`export_dir='.*'` is inside the model_dir's own files"):
            check_export_dir(str(inside), str(model_dir))
    check_export_dir(str(model_dir / "export"), str(model_dir))  # A directory of its own (docs/your-problem.md).
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("x")
    with pytest.raises(UserError) as raised:
        check_export_dir(str(tmp_path / "home"), str(model_dir))
    assert "holds files that are not an export (.bashrc); nothing was written" in str(raised.value)
    with pytest.raises(UserError, match="is a file, not a directory"):
        check_export_dir(str(tmp_path / "home" / ".bashrc"), None)
    earlier = tmp_path / "export"
    for name in ("variables", "assets"):
        (earlier / name).mkdir(parents=True)
    (earlier / "saved_model.pb").write_bytes(b"")
    (earlier / "fingerprint.pb").write_bytes(b"")
    check_export_dir(str(earlier), str(model_dir))  # An earlier export is replaced (a rerun exports again).
    check_export_dir(str(tmp_path / "new"), str(model_dir))
