"""engine/model_dir.py: one writer per model_dir, and a model_dir writes only inside itself
(docs/security.md).

The writer lock: exclusive within and across processes, taken over from a dead holder with a
warning, refused in one line when the lock file is not a regular file of its own, and gone
with its holder. The records are written through a temporary created exclusively, never
through a symbolic link; a link where the engine writes is refused in one line before anything
is written. The command line's side of the same (a second run exits 2, kill -9, signals) is
tests/cli/test_model_dir_cli.py's.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import REPO, file_tree, python_env, small_trainer

from engine import model_dir as model_dir_lib
from engine.cli.config.config_files import STORED_CONFIG
from engine.cli.run.inputs_record import INPUTS_FILE
from engine.cli.run.run_record import METRICS_FILE
from engine.diagnostics import DIAGNOSTICS_DIR
from engine.errors import UserError

# ----------------------------------------------------------------- the lock


def test_writer_lock_is_exclusive_and_leaves_nothing_behind(tmp_path):
    model_dir = tmp_path / "run"
    with model_dir_lib.writer_lock(str(model_dir)):
        assert model_dir_lib.holder_pid(str(model_dir)) == os.getpid()
        with pytest.raises(UserError, match=f"in use by pid {os.getpid()} on host"):
            with model_dir_lib.writer_lock(str(model_dir)):
                pass
    assert not model_dir.exists()  # created for the lock only, so removed again
    model_dir.mkdir()
    with model_dir_lib.writer_lock(str(model_dir)):
        pass
    assert list(model_dir.iterdir()) == []


def test_a_process_ending_at_once_removes_the_lock_files_it_holds(tmp_path):
    """What the signal watcher does before os._exit (a signal in start-up, or a second one):
    the lock file goes (and a model_dir made for it alone), the lock's own release after it is
    harmless, and the next writer finds no lock to take over."""
    made, kept = tmp_path / "made", tmp_path / "kept"
    kept.mkdir()
    (kept / "config.yaml").write_text("x: 1\n")
    with model_dir_lib.writer_lock(str(made)), model_dir_lib.writer_lock(str(kept)):
        model_dir_lib.abandon_writer_locks()
        assert not made.exists() and os.listdir(kept) == ["config.yaml"]
    model_dir_lib.abandon_writer_locks()  # None held: nothing to do.
    assert os.listdir(kept) == ["config.yaml"]


def test_a_model_dir_removed_while_makedirs_walks_it_is_made_again_and_a_file_there_is_refused(
    tmp_path, monkeypatch
):
    """What a concurrent holder's release does to makedirs (tensorflow says the path "is not a
    directory" when it vanishes mid-check): the lock is taken on the next try. A regular file
    where the model_dir should be still fails."""
    makedirs = tf.io.gfile.makedirs
    calls = []

    def vanishing_once(path):
        calls.append(path)
        if len(calls) == 1:
            raise tf.errors.FailedPreconditionError(None, None, f"{path} is not a directory")
        return makedirs(path)

    monkeypatch.setattr(tf.io.gfile, "makedirs", vanishing_once)
    model_dir = tmp_path / "new" / "run"
    with model_dir_lib.writer_lock(str(model_dir)):
        assert model_dir_lib.holder_pid(str(model_dir)) == os.getpid()
    assert len(calls) == 2
    monkeypatch.setattr(tf.io.gfile, "makedirs", makedirs)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(tf.errors.FailedPreconditionError):
        with model_dir_lib.writer_lock(str(tmp_path / "file")):
            pass


def _make_symlink(lock: Path, outside: Path) -> None:
    outside.write_bytes(b"the user's own file\n")
    lock.symlink_to(outside)


def _make_dangling_symlink(lock: Path, outside: Path) -> None:
    lock.symlink_to(outside)  # Would create a file outside the model_dir if followed.


def _make_hard_link(lock: Path, outside: Path) -> None:
    outside.write_bytes(b"the user's own file\n")
    os.link(outside, lock)


@pytest.mark.parametrize(
    "make, kind",
    [
        (_make_symlink, "a symbolic link to"),
        (_make_dangling_symlink, "a symbolic link to"),
        (_make_hard_link, "a file with 2 hard links"),
        (lambda lock, outside: lock.mkdir(), "a directory"),
        (lambda lock, outside: os.mkfifo(lock), "a FIFO"),  # Must not block: the test would hang.
    ],
    ids=["symlink", "dangling-symlink", "hard-link", "directory", "fifo"],
)
@pytest.mark.timeout(60)
def test_lock_file_that_is_not_a_regular_file_is_refused_and_nothing_is_written_through(tmp_path, make, kind):
    model_dir, outside = tmp_path / "run", tmp_path / "users-file.txt"
    model_dir.mkdir()
    (model_dir / "keep.txt").write_text("kept")
    lock = model_dir / model_dir_lib.LOCK_FILE
    make(lock, outside)
    before = file_tree(tmp_path)
    with pytest.raises(UserError) as raised:
        with model_dir_lib.writer_lock(str(model_dir)):
            pytest.fail("took a lock that is not a regular file of its own")
    message = str(raised.value)
    assert "\n" not in message and str(lock) in message and kind in message, message
    assert file_tree(tmp_path) == before  # The model_dir and the file outside it, byte-identical.


def test_lock_file_holding_binary_garbage_is_taken_over_with_a_warning(tmp_path, caplog):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / model_dir_lib.LOCK_FILE).write_bytes(b"\xff\xfe\x00garbage\x80" * 10)
    with model_dir_lib.writer_lock(str(model_dir)):
        assert model_dir_lib.holder_pid(str(model_dir)) == os.getpid()
    assert "took over the writer lock of an unknown process" in caplog.text
    assert list(model_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as `nobody` (a user the mode applies to)")
def test_unreadable_lock_file_is_one_line_for_a_user_it_applies_to(tmp_path):
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody").pw_uid
    parent = Path(tempfile.mkdtemp(prefix="lock-mode-000-"))  # tmp_path is root's alone (mode 700).
    try:
        parent.chmod(0o777)
        model_dir = parent / "run"
        model_dir.mkdir(mode=0o777)
        model_dir.chmod(0o777)
        lock = model_dir / model_dir_lib.LOCK_FILE
        lock.write_text('{"host": "h", "pid": 1, "since": "s"}')
        lock.chmod(0o000)
        before = file_tree(parent)
        os.seteuid(nobody)
        try:
            with pytest.raises(UserError) as raised:
                with model_dir_lib.writer_lock(str(model_dir)):
                    pass
        finally:
            os.seteuid(0)
        message = str(raised.value)
        assert "\n" not in message and f"cannot open the lock file {lock}" in message, message
        assert "Permission denied" in message, message
        assert file_tree(parent) == before
    finally:
        shutil.rmtree(parent)


# Takes and releases the lock `argv[2]` times in each of `argv[4]` processes: this one and the
# copies it forks once the engine is imported (one import of TensorFlow instead of one each, some
# 3 CPU-s apiece; nothing is open at the fork). Each prints its own "taken" line; this one exits 0
# only if every copy did.
_TAKE_IN_A_LOOP = """
import os, sys, time, traceback
from engine import model_dir as m
from engine.errors import UserError


def take_in_a_loop():
    while not os.path.exists(sys.argv[3]):  # All start at once, after the slow import.
        time.sleep(0.01)
    taken = 0
    for _ in range(int(sys.argv[2])):
        try:
            with m.writer_lock(sys.argv[1]):
                assert m.holder_pid(sys.argv[1]) == os.getpid()
                taken += 1
        except UserError as error:
            assert "is in use by" in str(error), error
    print(os.getpid(), "taken", taken, flush=True)


copies = []
for _ in range(int(sys.argv[4]) - 1):
    pid = os.fork()
    if pid == 0:  # A copy: it takes the lock, says how it ended, and exits at once (none of the
        try:  # parent's exit handlers run in it).
            take_in_a_loop()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    copies.append(pid)
take_in_a_loop()
statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in copies]
assert statuses == [0] * len(copies), statuses
"""


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_processes_taking_the_lock_in_a_tight_loop_on_a_new_model_dir_never_fail(tmp_path):
    """Each take makes the model_dir and removes it again on release: the others
    open the lock file in a directory that comes and goes."""
    model_dir, start = tmp_path / "new" / "run", tmp_path / "start"
    processes = 3
    run = subprocess.Popen(
        [sys.executable, "-c", _TAKE_IN_A_LOOP, str(model_dir), "2000", str(start), str(processes)],
        cwd=REPO,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        start.touch()
        out, err = run.communicate(timeout=200)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, err[-3000:]
    # A line of each process's own.
    assert len({line.split()[0] for line in out.splitlines() if " taken " in line}) == processes, out
    # Released each time: no lock file left (an empty model_dir may stay when the last
    # holder is not the process that made it).
    assert not model_dir.exists() or list(model_dir.iterdir()) == []


# ------------------------------------------------------------ the model_dir's path


def test_the_trainer_refuses_a_model_dir_path_component_longer_than_the_file_system_allows(tmp_path):
    with pytest.raises(UserError, match=r"`model_dir=\.\.\.` has a path component of 300 bytes"):
        small_trainer(tmp_path / ("b" * 300))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------- a model_dir writes only inside itself


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
