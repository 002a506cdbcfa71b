"""Everything that touches a model_dir as a whole: its name, the names and kinds of
the files and directories the engine keeps there, the writer lock, JSON files
written atomically, and a full disk or a lost directory as a user error.

One concern, one place, because each of these lost work when done ad hoc:
TensorFlow matches checkpoint paths as glob patterns (a `[` in a name reached
a sibling directory's files) and two runs on one directory overwrote each
other's `ckpt-N`. Finding, reading and recovering the checkpoints in it is
`engine.checkpointing.discovery`'s. Files go through `tf.io.gfile`, so the
same code serves local disks and remote file systems.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import tensorflow as tf

from engine.errors import UserError, one_line, printable
from engine.logger import logger

LOCK_FILE = ".writer.lock"
STATE_FILE = "checkpoint"  # What tf.train.CheckpointManager names its state file.
DAMAGED_STATE_SUFFIX = ".damaged"
SUPERSEDED_SUBDIR = "superseded"  # Checkpoint files moved aside rather than overwritten.
# TensorFlow's file matching (tf.io.gfile.glob, CheckpointManager rotation) treats these as patterns.
GLOB_CHARACTERS = "*?[]\\"


def check_name(model_dir: str, argument: str = "model_dir") -> None:
    """Refuses names TensorFlow would read as glob patterns: with them, checkpoint
    rotation and discovery reach files outside the directory. And names no file
    system takes (`check_path_length`)."""
    bad = sorted({c for c in model_dir if c in GLOB_CHARACTERS})
    if bad:
        raise UserError(
            f"`{argument}={model_dir!r}` contains {''.join(bad)!r}, which TensorFlow matches as a file "
            "pattern (checkpoint rotation could delete files of other directories); "
            "use a path without * ? [ ] \\"
        )
    check_path_length(model_dir, argument)


# What Linux file systems take when `pathconf` cannot say: NAME_MAX and PATH_MAX.
_NAME_MAX, _PATH_MAX = 255, 4096
# The longest name the engine adds under a model_dir ("checkpoints/ckpt-N_temp/part-...").
_ENGINE_SUFFIX = 96


def check_path_length(path: str, argument: str) -> None:
    """Refuses a local path with a component longer than its file system allows (a
    traceback from deep inside TensorFlow's makedirs once the run was under way), or
    one too long as a whole to hold what the engine writes under it."""
    if not path or is_remote(path):
        return
    existing = os.path.abspath(path)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    name_max, path_max = _NAME_MAX, _PATH_MAX
    with contextlib.suppress(OSError, ValueError):
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    for component in path.split(os.sep):
        size = len(os.fsencode(component))
        if size > name_max:
            raise UserError(
                f"`{argument}=...` has a path component of {size} bytes ({component[:40]!r}...), longer than "
                f"the {name_max} its file system allows; use shorter names"
            )
    size = len(os.fsencode(os.path.abspath(path)))
    if size + _ENGINE_SUFFIX > path_max:
        raise UserError(
            f"`{argument}=...` is {size} bytes long; with what the run writes under it that is more than the "
            f"{path_max} its file system allows for a path; use a shorter path"
        )


# What the engine keeps in a model_dir's subdirectories, by name.
SUBDIRECTORIES = {
    "checkpoints": "checkpoints",
    "best": "best checkpoint",
    "hooks": "hook state",
    "train": "TensorBoard logs",
    "eval": "TensorBoard logs",
    "diagnostics": "diagnostics reports",  # engine.diagnostics.DIAGNOSTICS_DIR
}
# The directories of a model_dir that hold checkpoints: the rolling ones and the best one.
CHECKPOINT_SUBDIRECTORIES = ("checkpoints", "best")
# The records the engine keeps at the top of a model_dir (run_record.METRICS_FILE,
# config_files.STORED_CONFIG, inputs_record.INPUTS_FILE; tests/unit/test_model_dir.py checks).
RECORD_FILES = ("metrics.json", "config.yaml", "inputs.json")


def check_kinds(model_dir: str) -> None:
    """Refuses a model_dir, or a subdirectory the engine keeps there, that is not a
    directory (a regular file in its place was a FailedPreconditionError traceback
    after parts of the run had been written). Locally, also any symbolic link the
    engine would write through (`check_no_links`)."""
    for path, what in [(model_dir, "everything of the run")] + [
        (os.path.join(model_dir, name), what) for name, what in SUBDIRECTORIES.items()
    ]:
        if not is_remote(path) and path != model_dir:
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    continue  # check_no_links names it.
        if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
            continue
        kind = "a file"
        if not is_remote(path):
            with contextlib.suppress(OSError):
                status = os.lstat(path)
                kind = "a regular file" if stat.S_ISREG(status.st_mode) else _file_kind(status.st_mode)
        raise UserError(
            f"{path} is {kind}, not a directory: the run keeps its {what} there; move it away "
            "or pass another `model_dir`"
        )
    check_no_links(model_dir)


def check_no_links(model_dir: str) -> None:
    """Refuses a symbolic link where the engine writes in a local model_dir, before anything
    is written: one of its subdirectories (`SUBDIRECTORIES`), anything below them, or a
    record at its top (`RECORD_FILES`). A model_dir from someone else is data: a
    `checkpoints -> elsewhere` link had a run write its checkpoints there (and rename that
    directory's files), a `metrics.json -> file` link would be read as the run's record.
    The model_dir itself may be a link: that is the path the user chose."""
    if is_remote(model_dir) or not os.path.isdir(model_dir):
        return
    check_no_record_links(model_dir)
    for name, what in SUBDIRECTORIES.items():
        top = os.path.join(model_dir, name)
        _refuse_link(top, f"its {what}")
        pending = [top] if os.path.isdir(top) else []
        while pending:
            with contextlib.suppress(OSError), os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        _refuse_link(entry.path, f"its {what}")
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)


def check_no_record_links(model_dir: str) -> None:
    """Refuses a record at the top of a local model_dir (`RECORD_FILES`) that is a symbolic
    link: read, it would bring a file from outside into the run's settings or record.
    Refused rather than replaced, so that nothing the link points to is read or copied."""
    if not is_remote(model_dir):
        for name in RECORD_FILES:
            _refuse_link(os.path.join(model_dir, name), f"the run's {name}")


def _refuse_link(path: str, what: str) -> None:
    try:
        target = os.readlink(path)
    except OSError:  # Missing, or not a link.
        return
    raise UserError(
        f"{path} is a symbolic link (to {target}), where the run writes {what}: nothing was written "
        "through it; remove the link (only it, not what it points to) or pass another `model_dir`"
    )


# ------------------------------------------------------------------ the writer lock


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        # Text of the model_dir's lock file, printed escaped.
        return printable(f"pid {holder['pid']} on host {holder['host']} (since {holder['since']})")
    except (ValueError, KeyError, TypeError):
        return "an unknown process (unreadable lock file)"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Opening never follows a symlink (O_NOFOLLOW) and never blocks on a FIFO (O_NONBLOCK).
_LOCK_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_LOCK_RECORD_BYTES = 4096  # A record is ~100 bytes; a larger file is not the engine's.
# A model_dir that a finishing run removes (made for its lock only) while we open: tries before giving up.
_LOCK_OPEN_TRIES = 100


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _not_a_lock_file(path: str, what: str) -> UserError:
    return UserError(
        f"{path} is {what}, not the engine's lock file; nothing was written through it: if no run "
        "uses this `model_dir`, remove that entry (only it, not what it points to), or pass another `model_dir`"
    )


def _open_lock_file(model_dir: str, path: str) -> tuple[int, bool]:
    """A descriptor of `path` as a regular file of its own, created if missing, and
    whether the model_dir was made for it.

    Never follows a symlink (whose target may be a user's file outside the
    model_dir), never blocks on a FIFO, and refuses anything but a regular
    file with one link (a hard link would be written through too). Retries
    when a run that made the model_dir for its lock alone removes it between
    our makedirs and open.
    """
    for _ in range(_LOCK_OPEN_TRIES):
        created = not tf.io.gfile.exists(model_dir)
        try:
            tf.io.gfile.makedirs(model_dir)
        except (tf.errors.FailedPreconditionError, tf.errors.NotFoundError) as error:
            # TensorFlow says "is not a directory" when a holder removes the directory while
            # makedirs checks it; a file where the model_dir should be is still an error.
            # One stat answers both (exists, then isdir, would race the same removal).
            try:
                in_the_way = not stat.S_ISDIR(os.stat(model_dir).st_mode)
            except FileNotFoundError:
                in_the_way = False
            except NotADirectoryError:  # A file where one of its parents should be.
                in_the_way = True
            if in_the_way:
                raise error
            continue
        try:
            fd = os.open(path, _LOCK_OPEN_FLAGS, 0o644)
        except FileNotFoundError:
            continue  # The model_dir went away with its previous holder: make it again.
        except OSError as error:
            try:
                kind = _file_kind(os.lstat(path).st_mode)
            except OSError:
                kind = "unknown"
            if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
                if kind == "a symbolic link":
                    kind = f"a symbolic link to {os.readlink(path)}"
                raise _not_a_lock_file(path, kind) from None
            raise UserError(
                f"cannot open the lock file {path} ({error.strerror}); if no run uses this `model_dir`, "
                "make it readable and writable by this user or remove it, or pass another `model_dir`"
            ) from None
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
            os.close(fd)
            what = (
                _file_kind(status.st_mode)
                if not stat.S_ISREG(status.st_mode)
                else (f"a file with {status.st_nlink} hard links")
            )
            raise _not_a_lock_file(path, what)
        os.set_blocking(fd, True)
        return fd, created
    raise UserError(f"{model_dir} kept disappearing while taking its lock {path}; is another tool removing it?")


def _read_record(fd: int) -> str:
    """The lock file's text; bytes that are not UTF-8 (garbage) become U+FFFD, not an error."""
    return os.pread(fd, _LOCK_RECORD_BYTES, 0).decode("utf-8", errors="replace")


@contextlib.contextmanager
def writer_lock(model_dir: str) -> Iterator[None]:
    """Holds `<model_dir>/.writer.lock` exclusively for the `with` block.

    The lock is an `fcntl.flock` on that file, which the kernel releases when
    the process dies in any way (kill -9 included), so a crashed run never
    blocks a rerun; the file records host, pid and start time so that a
    refused run can say who holds the directory, and a rerun after a crash
    says whose lock it took over. The file is removed on a clean exit, so a
    run refused for bad input leaves the model_dir as it found it (and a
    model_dir created only for the lock is removed again).

    The file is the engine's own and nothing else: a symlink, directory,
    FIFO, hard link or unreadable file in its place is refused with one line
    and left as it is; a regular file with garbage in it is taken over with
    a warning.

    Only one writer per model_dir: training takes it; readers (an evaluator)
    must not. `flock` is enforced between processes of one host and on file
    systems that support it (local disks, NFSv4); elsewhere the recorded
    holder still makes a concurrent run of another host visible in the logs.
    A remote model_dir (gs://, ram://, any `scheme://`) has no lock: a warning
    says so and the block runs unguarded.
    """
    if is_remote(model_dir):
        logger.warning(
            "`model_dir=%r` is not a local directory: it has no writer lock, so make sure "
            "no other run writes to it",
            model_dir,
        )
        with _held_here(model_dir):
            yield
        return
    path = os.path.join(model_dir, LOCK_FILE)
    created = False
    while True:
        fd, made = _open_lock_file(model_dir, path)
        created = created or made
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = _describe_holder(_read_record(fd))
            os.close(fd)
            raise UserError(
                f"`model_dir={model_dir!r}` is in use by {holder}; wait for that run to end, "
                "or pass another `model_dir`"
            ) from None
        try:
            same_file = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # The previous holder removed the file between our open and flock: retry.
    previous = _read_record(fd).strip()
    if previous:
        holder = _describe_holder(previous)
        logger.warning(
            "took over the writer lock of %s in %s: that run ended without releasing it (killed?)",
            holder,
            model_dir,
        )
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError:  # A full disk: leave no empty lock file (nor a model_dir made for it) behind.
        _release(model_dir, path, fd, created)
        raise
    _lock_files[fd] = (model_dir, path, created)
    try:
        with _held_here(model_dir):
            yield
    finally:
        _release(model_dir, path, fd, created)


# The model_dirs whose writer lock this process holds (`writer_lock`), by `lock_key`.
_held: set[str] = set()
# The lock files this process holds, by descriptor: (model_dir, path, whether it made the model_dir).
_lock_files: dict[int, tuple[str, str, bool]] = {}


def abandon_writer_locks() -> None:
    """Removes the lock files this process holds, for a process about to end at once (`os._exit`
    on a signal in start-up, or a second one) without running the `finally` that releases them.

    Called from another thread (the signal watcher) while the main thread runs on: it removes
    files only, never closes a descriptor (the main thread may be releasing the same lock and
    a closed number can be reused at once); the kernel drops the `flock` at the exit. A
    model_dir made for the lock alone is removed too, if it is still empty."""
    for model_dir, path, created in list(_lock_files.values()):
        with contextlib.suppress(OSError):
            os.remove(path)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(model_dir)


def lock_key(path: str) -> str:
    """What this process knows a directory by: its real path (a remote path as given)."""
    return path if is_remote(path) else os.path.realpath(path)


def holds_writer_lock(model_dir: str) -> bool:
    """Whether this process holds `model_dir`'s writer lock (`writer_lock`)."""
    return lock_key(model_dir) in _held


@contextlib.contextmanager
def _held_here(model_dir: str) -> Iterator[None]:
    key = lock_key(model_dir)
    _held.add(key)
    try:
        yield
    finally:
        _held.discard(key)


def _release(model_dir: str, path: str, fd: int, created: bool) -> None:
    _lock_files.pop(fd, None)
    with contextlib.suppress(OSError):
        os.remove(path)  # Still holding the lock: nobody else can be between.
    os.close(fd)
    if created:
        with contextlib.suppress(OSError):  # Only when the refused run left it empty.
            os.rmdir(model_dir)


def holder_pid(model_dir: str) -> int | None:
    """The pid recorded in a model_dir's lock file, if any (for tests and tools)."""
    try:
        fd = os.open(os.path.join(model_dir, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return int(json.loads(_read_record(fd))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------ a model_dir lost mid-run


class DirectoryWatch:
    """Notices that directories a run writes to were removed, replaced or made unwritable
    while it ran: TensorFlow's writes make a removed directory again without a word (a new,
    empty model_dir: the checkpoints, config and lock gone), or fail with a traceback from
    deep inside a save.

    Each directory is known by its identity (device and inode) from when it is first seen;
    `problem()` says what became of them. Remote directories (gs://, ...) are not watched.
    """

    def __init__(self, *paths: str):
        self.paths = [path for path in paths if not is_remote(path)]
        self._identities: dict[str, tuple[int, int]] = {}
        self.note()

    def note(self) -> None:
        """Takes the identity of each directory that exists now and has none yet."""
        for path in self.paths:
            if path not in self._identities:
                with contextlib.suppress(OSError):
                    status = os.stat(path)
                    if stat.S_ISDIR(status.st_mode):
                        self._identities[path] = (status.st_dev, status.st_ino)

    def problem(self, error: BaseException | None = None) -> str | None:
        """What became of the first watched directory that is not as it was ("... was
        removed during the run", "... was replaced by ...", "... is not writable
        anymore"), or None. `error`, what a write met, counts a denied permission."""
        for path in self.paths:
            known = self._identities.get(path)
            if known is None:
                continue
            try:
                status = os.lstat(path)
            except FileNotFoundError:
                return f"{path} was removed during the run"
            except OSError as failed:  # A parent made unreadable, or removed and replaced.
                return f"{path} cannot be reached anymore ({failed.strerror})"
            if stat.S_ISLNK(status.st_mode):
                with contextlib.suppress(OSError):
                    status = os.stat(path)
            if not stat.S_ISDIR(status.st_mode):
                kind = "a regular file" if stat.S_ISREG(status.st_mode) else _file_kind(status.st_mode)
                return f"{path} was replaced by {kind} during the run"
            if (status.st_dev, status.st_ino) != known:
                return f"{path} was removed during the run (and made again since)"
        for path in self.paths:
            if path in self._identities and (not os.access(path, os.W_OK | os.X_OK) or _denied(error)):
                return f"{path} is not writable anymore"
        return None


def _denied(error: BaseException | None) -> bool:
    """Whether a write failed for a permission or a read-only file system."""
    if isinstance(error, OSError):
        return error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    text = str(error) if error is not None else ""
    return isinstance(error, tf.errors.PermissionDeniedError) or "Read-only file system" in text


def is_remote(path: str) -> bool:
    """A path that only TensorFlow's file systems reach (gs://, ram://, ...), not `os`."""
    return "://" in path


def remove_tree(path: str) -> None:
    """Removes a directory tree if it is there (any file system)."""
    with contextlib.suppress(tf.errors.NotFoundError):
        tf.io.gfile.rmtree(path)


def remove_if_empty(path: str) -> None:
    """Removes a local directory only if it is empty (atomically: another process may fill it);
    on a remote file system directories are prefixes that vanish with their files."""
    if not is_remote(path):
        with contextlib.suppress(OSError):
            os.rmdir(path)


# ----------------------------------------------------------------- JSON files


def read_json(path: str, *, what: str) -> Any | None:
    """The JSON value in `path`; None when there is no such file.

    Anything else that is not JSON (garbage, empty, a directory) is a
    UserError naming the file and `what` it holds.
    """
    if not tf.io.gfile.exists(path):
        return None
    if tf.io.gfile.isdir(path):
        raise UserError(f"{path} ({what}) is a directory, not a JSON file; move it away")
    try:
        with tf.io.gfile.GFile(path, "r") as handle:
            return json.loads(handle.read())
    except (ValueError, UnicodeDecodeError, tf.errors.OpError) as error:
        raise UserError(
            f"{path} ({what}) is damaged ({one_line(error, 120)}); restore it from a backup or move it away"
        ) from None


def write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Writes atomically (a temporary file, then a rename), so a reader never
    sees half a file; a directory in the way is a UserError, not a traceback."""
    if tf.io.gfile.isdir(path):
        raise UserError(f"cannot write {path}: it is a directory; move it away")
    directory = os.path.dirname(path)
    if directory:
        tf.io.gfile.makedirs(directory)
    write_atomically(path, json.dumps(dict(payload), indent=2, sort_keys=True))


def write_atomically(path: str, text: str | bytes) -> None:
    """A temporary file, then a rename: a reader (or a crash) never sees half a file.

    Locally the temporary is created exclusively, under a name nobody can guess,
    never through a symbolic link (`tempfile.mkstemp`: O_CREAT|O_EXCL|O_NOFOLLOW), in
    `path`'s own directory, and synced before the rename; the rename replaces a link
    at `path` itself, never what it points to. A model_dir from someone else that
    holds `metrics.json.tmp<pid> -> ~/.bashrc` links had the user's file replaced
    with the old predictable name. Remote file systems (gs://, ram://) have no links:
    their temporary goes through `tf.io.gfile` under a random name.
    """
    data = text.encode() if isinstance(text, str) else text
    if is_remote(path):
        temporary = f"{path}.tmp-{uuid.uuid4().hex}"  # Private to this process (an evaluator writes too).
        with tf.io.gfile.GFile(temporary, "wb") as handle:
            handle.write(data)
        tf.io.gfile.rename(temporary, path, overwrite=True)
        return
    directory, name = os.path.split(path)
    fd, temporary = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())  # mkstemp's 0600, as `open` would have made it.
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (`os.umask` sets it for every thread)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


@contextlib.contextmanager
def disk_full_is_a_user_error(model_dir: str) -> Iterator[None]:
    """A full disk anywhere in the block (the lock, event files, the best checkpoint)
    becomes one line naming `model_dir` and its free space, not a traceback."""
    try:
        yield
    except (OSError, tf.errors.OpError) as error:
        # Not any ResourceExhaustedError here: out of (GPU) memory is one too.
        full = isinstance(error, OSError) and error.errno == errno.ENOSPC
        message = disk_full_message(model_dir, error)
        if message is None or not (full or "No space left on device" in str(error)):
            raise
        raise UserError(message) from None


@contextlib.contextmanager
def lost_directory_is_a_user_error(model_dir: str) -> Iterator[DirectoryWatch]:
    """A write in the block that fails because the model_dir was removed, replaced or made
    unwritable since the block began becomes one line saying so, not a traceback; the
    watch it yields tells the block itself (`check_still_there`) before a last write."""
    watch = DirectoryWatch(model_dir)
    try:
        yield watch
    except (OSError, tf.errors.OpError):
        problem = watch.problem()  # Not the error's denied permission: a data file may have met it.
        if problem is None:
            raise
        raise UserError(lost_message(problem)) from None


def check_still_there(watch: DirectoryWatch) -> None:
    """Refuses to write into a model_dir that is not the one the run began with (a removed
    one would be made again, holding only what is written now)."""
    problem = watch.problem()
    if problem is not None:
        raise UserError(lost_message(problem))


def lost_message(problem: str) -> str:
    return (
        f"{problem}; the run stopped: put the `model_dir` back as it was and rerun to continue, "
        "or pass another `model_dir`"
    )


def disk_full_message(path: str, error: BaseException) -> str | None:
    """A one-line explanation if `error` says the disk under `path` is full."""
    text = str(error)
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    full = full or "No space left on device" in text or isinstance(error, tf.errors.ResourceExhaustedError)
    if not full:
        return None
    try:
        usage = shutil.disk_usage(os.path.dirname(path) or ".")
        free = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB"
    except OSError:
        free = "free space unknown"
    return f"the disk holding {path} is full ({free}); free space or use another `model_dir`"
