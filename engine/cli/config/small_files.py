"""The small files a command reads before it runs (config files, flagfiles, the model_dir's
`config.yaml` and records), read so that no file can hang or flood it.

A FIFO with no writer blocks `open()` forever, a character device (/dev/zero) never ends,
and a huge file is read whole into memory: each is one line naming the file instead. A
local file must be a regular file of at most `limit` bytes, checked with `os.stat` before
it is opened, then opened without blocking (O_NONBLOCK) and checked again on the open
descriptor, so that a FIFO swapped in between blocks nothing either. A remote file
(gs://, ...) is read through TensorFlow's file systems, at most `limit` bytes of it.

This module imports no TensorFlow (the flagfiles are checked before it is imported).
"""

from __future__ import annotations

import os
import stat

from engine.errors import UserError, one_line

# A config file holds settings; a megabyte is thousands of times what one needs.
MAX_SETTINGS_FILE_BYTES = 2**20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for messages."""
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_small_file(path: str, where: str, *, fix: str, limit: int = MAX_SETTINGS_FILE_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; anything else (missing,
    a directory, a FIFO or device, larger, unreadable) is a UserError naming `where`, then `fix`."""
    if "://" in path:
        return _read_remote(path, where, fix=fix, limit=limit)
    try:
        status = os.stat(path)
        _check_kind(status.st_mode, status.st_size, where, fix=fix, limit=limit)
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise UserError(f"{where} does not exist; {fix}") from None
    except OSError as error:
        raise UserError(f"{where} cannot be read ({error.strerror or one_line(error, 120)}); {fix}") from None
    try:
        status = os.fstat(fd)  # What was opened: the name may have been swapped since the stat.
        _check_kind(status.st_mode, status.st_size, where, fix=fix, limit=limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        raise UserError(f"{where} cannot be read ({error.strerror or one_line(error, 120)}); {fix}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:  # It grew while being read.
        raise UserError(_too_large(where, len(data), limit, fix))
    return data


def _check_kind(mode: int, size: int, where: str, *, fix: str, limit: int) -> None:
    if stat.S_ISDIR(mode):
        raise UserError(f"{where} is a directory; {fix}")
    if not stat.S_ISREG(mode):
        raise UserError(f"{where} is {file_kind(mode)}, not a regular file; {fix}")
    if size > limit:
        raise UserError(_too_large(where, size, limit, fix))


def _too_large(where: str, size: int, limit: int, fix: str) -> str:
    return f"{where} is {size} bytes, more than the {limit} bytes such a file may hold; {fix}"


def _read_remote(path: str, where: str, *, fix: str, limit: int) -> bytes:
    import tensorflow as tf

    try:
        if tf.io.gfile.isdir(path):
            raise UserError(f"{where} is a directory; {fix}")
        size = tf.io.gfile.stat(path).length
        if size > limit:
            raise UserError(_too_large(where, size, limit, fix))
        with tf.io.gfile.GFile(path, "rb") as handle:
            data = handle.read(limit + 1)
    except tf.errors.NotFoundError:
        raise UserError(f"{where} does not exist; {fix}") from None
    except (tf.errors.OpError, OSError) as error:
        raise UserError(f"{where} cannot be read ({one_line(error, 120)}); {fix}") from None
    if len(data) > limit:
        raise UserError(_too_large(where, len(data), limit, fix))
    return data


def is_shell_pipe(path: str) -> bool:
    """A pipe the shell opened for this process (`--flagfile=<(...)`: /dev/fd/N): it has a
    writer, so reading it ends. A named FIFO elsewhere may have none and block forever."""
    return path.startswith(("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/"))


# The directories of a model_dir whose files a command reads (engine.model_dir.SUBDIRECTORIES).
_READ_SUBDIRECTORIES = ("checkpoints", "best", "hooks")
_LOCK_FILE = ".writer.lock"  # Opened without blocking by engine.model_dir.writer_lock, which names it.


def check_model_dir_entries(model_dir: str) -> None:
    """Refuses a local model_dir where a file a command reads (config.yaml, metrics.json, the
    checkpoints and their state files, best/, hooks/) is a FIFO, socket or device: opening a FIFO
    nothing writes to blocks forever, in Python's code or in TensorFlow's. Regular files,
    directories and dangling links are left to the readers, which name them."""
    if "://" in model_dir or not os.path.isdir(model_dir):
        return
    directories = [model_dir, *(os.path.join(model_dir, name) for name in _READ_SUBDIRECTORIES)]
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue  # Missing, or not a directory: engine.model_dir.check_kinds names it.
        for name in names:
            if directory == model_dir and name == _LOCK_FILE:
                continue
            path = os.path.join(directory, name)
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise UserError(
                    f"{path} is {file_kind(mode)}, not a regular file: a command reads the model_dir's files "
                    "and would wait on it forever; move it away, or pass another --model_dir"
                )
