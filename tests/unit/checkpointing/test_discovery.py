"""engine/checkpointing/discovery.py: the checkpoints of a directory found by listing, never by
a pattern, and read by their names in it, so a copied or moved model_dir resumes from its own
files; the folders of a write cut short removed at the next start, under the writer lock, and
nothing else. The command line's side (a lost state file, a kill inside a merge) is
tests/cli/test_model_dir_cli.py's.
"""

import json
import os
import re
from pathlib import Path

import pytest
from helpers import copy_of, small_trainer, snapshot

from engine import model_dir as model_dir_lib
from engine.checkpointing import discovery
from engine.errors import UserError

# ------------------------------------------------ partial folders of writes cut short

PART_FILES = ("part-00000-of-00001.index", "part-00000-of-00001.data-00000-of-00001.tempstate123")


def _partial(folder: Path, *extra: str) -> Path:
    """What a checkpoint write cut short leaves: a folder of TensorFlow's part files (and `extra`)."""
    folder.mkdir(parents=True)
    for name in (*PART_FILES, *extra):
        (folder / name).write_bytes(b"half a checkpoint")
    return folder


def test_a_library_start_removes_partial_checkpoint_folders_and_nothing_else(tmp_path, caplog):
    rolling = _partial(tmp_path / "checkpoints" / "ckpt-7_temp")
    best = _partial(tmp_path / "best" / "ckpt-3_temp")
    outside = _partial(tmp_path.parent / f"{tmp_path.name}-outside")
    kept = [
        _partial(tmp_path / "checkpoints" / "notes_temp"),  # Not the engine's name.
        _partial(tmp_path / "checkpoints" / "ckpt-8_temp", "mine.txt"),  # Holds a file the engine never writes.
        tmp_path / "checkpoints" / "ckpt-10_temp",  # A file, not a folder.
    ]
    kept[2].write_text("a user's file")
    link = tmp_path / "checkpoints" / "ckpt-9_temp"  # A link, to files outside the model_dir.
    link.symlink_to(outside, target_is_directory=True)
    outside_before = snapshot(outside)
    # A save at step 9 would write through it (issue 48): the start is refused, nothing removed.
    with pytest.raises(UserError, match=f"{re.escape(str(link))} is a symbolic link"):
        small_trainer(tmp_path)
    assert rolling.exists() and best.exists() and snapshot(outside) == outside_before
    link.unlink()

    trainer = small_trainer(tmp_path)  # Research code: no writer lock of its own.

    assert not rolling.exists() and not best.exists()
    assert all(path.exists() or path.is_symlink() for path in kept)
    assert snapshot(outside) == outside_before
    assert not (tmp_path / model_dir_lib.LOCK_FILE).exists()  # Taken for the removal, released.
    assert f"removing {rolling}, left by a checkpoint write that did not finish" in caplog.text
    assert f"left {kept[1]}" in caplog.text and "mine.txt" in caplog.text
    trainer.close()


def test_partial_folders_stay_while_another_run_holds_the_writer_lock(tmp_path, caplog):
    import fcntl

    partial = _partial(tmp_path / "checkpoints" / "ckpt-7_temp")
    # Another process's lock: a lock of another open file is refused within a process too.
    fd = os.open(tmp_path / model_dir_lib.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, json.dumps({"host": "h", "pid": 1, "since": "then"}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        small_trainer(tmp_path).close()
        assert partial.exists(), "may be the write of the run under way"
        assert "which may be the write of a run under way" in caplog.text and "in use by pid 1" in caplog.text
    finally:
        os.close(fd)
    small_trainer(tmp_path).close()  # Its lock free again: the next start removes it.
    assert not partial.exists()


@pytest.mark.parametrize("name", ["run[1]", "run*", "run?"])
def test_removing_partial_folders_never_reaches_a_sibling_a_pattern_would_match(tmp_path, name):
    sibling = _partial(tmp_path / "run1" / "checkpoints" / "ckpt-5_temp")
    own = _partial(tmp_path / name / "checkpoints" / "ckpt-5_temp")
    discovery.remove_partial_checkpoints(str(tmp_path / name))
    assert not own.exists() and sorted(p.name for p in sibling.iterdir()) == sorted(PART_FILES)


# --------------------------------------- read by their names: a copy resumes from its own files


def _state_paths(model_dir: Path) -> list[str]:
    text = (model_dir / "checkpoints" / model_dir_lib.STATE_FILE).read_text()
    return re.findall(r'checkpoint_paths?: "(.*)"', text)


@pytest.mark.parametrize("written_by", ["recovery", "an older version"])
def test_copied_and_moved_model_dirs_resume_from_their_own_checkpoints(tmp_path, written_by):
    import tensorflow as tf

    original = tmp_path / "original"
    small_trainer(original).train(4)  # ckpt-2, ckpt-4
    state = original / "checkpoints" / model_dir_lib.STATE_FILE
    if written_by == "recovery":
        state.unlink()
        small_trainer(original)  # Rebuilds the state file from the files on disk.
        assert _state_paths(original) == ["ckpt-4", "ckpt-2", "ckpt-4"]  # Names, not paths.
    else:
        directory = str(original / "checkpoints")
        tf.compat.v1.train.update_checkpoint_state(
            directory,
            f"{directory}/ckpt-4",
            all_model_checkpoint_paths=[f"{directory}/ckpt-2", f"{directory}/ckpt-4"],
        )
    copy = copy_of(original, tmp_path / "copy")
    moved = tmp_path / "moved"
    original.rename(moved)
    for model_dir in (copy, moved):
        trainer = small_trainer(model_dir)
        assert trainer.step == 4
        assert trainer.checkpoint_manager.latest_checkpoint == str(model_dir / "checkpoints" / "ckpt-4")
        trainer.train(6)
        assert all("/" not in path for path in _state_paths(model_dir)), _state_paths(model_dir)
        assert sorted(p.name for p in (model_dir / "checkpoints").glob("ckpt-*.index")) == [
            "ckpt-2.index",
            "ckpt-4.index",
            "ckpt-6.index",
        ]
    assert not original.exists()  # Nothing was written back to where the original was.
    # What the evaluator reads, too (it never rewrites the state file).
    for model_dir in (copy, moved):
        latest = str(model_dir / "checkpoints" / "ckpt-6")
        assert discovery.latest_checkpoint(str(model_dir / "checkpoints")) == latest
