"""Repairs of a model_dir's on-disk state that a refused run takes back.

A run checks everything before it writes, but some checks need the state
repaired first (a recovered state file names the checkpoint whose match with
the model is checked). A refused run must leave the model_dir byte-identical,
so inside `undone_on_error()` each repair made through this module records
how to take it back; outside it (the Trainer API, the evaluator) repairs are
made for good at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import tensorflow as tf

from engine.errors import one_line
from engine.logger import logger


class _Repairs:
    """What the repairs of on-disk state did, to undo in reverse if the run is refused.

    A run checks everything before it writes, but some checks need the state
    repaired first (a recovered state file names the checkpoint whose match
    with the model is checked). A refused run must leave the model_dir
    byte-identical, so each repair records how to take it back; a removed
    file is only moved to a sibling `.repair-<pid>` directory until then.
    """

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.trash: list[str] = []

    def roll_back(self) -> None:
        for step in reversed(self.undo):
            try:
                step()
            except (OSError, tf.errors.OpError) as error:  # Undo what can be: the rest is named.
                logger.warning("could not undo a repair of the model_dir: %s", one_line(error, 200))
        self.keep()

    def keep(self) -> None:
        for directory in self.trash:
            with contextlib.suppress(tf.errors.NotFoundError):
                tf.io.gfile.rmtree(directory)


_repairs: _Repairs | None = None


@contextlib.contextmanager
def undone_on_error() -> Iterator[None]:
    """Every repair (the functions of this module) made inside the block is undone if the block raises
    before `keep()`; without the block, repairs are made for good at once."""
    global _repairs
    _repairs = _Repairs()
    try:
        yield
    except BaseException:
        repairs, _repairs = _repairs, None
        if repairs is not None:
            repairs.roll_back()
        raise
    finally:
        keep()


def keep() -> None:
    """Makes the repairs made so far final: every check has passed."""
    global _repairs
    repairs, _repairs = _repairs, None
    if repairs is not None:
        repairs.keep()


def write(path: str, write: Callable[[], None]) -> None:
    """Runs `write`, which replaces the small file `path` (a state file), undoably."""
    if _repairs is not None:
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path, "rb") as handle:
                before = handle.read()

            def put_back() -> None:
                from engine.model_dir import write_atomically  # engine.model_dir is above this module.

                write_atomically(path, before)  # Never through a link planted meanwhile.

            _repairs.undo.append(put_back)
        else:
            _repairs.undo.append(lambda: tf.io.gfile.remove(path) if tf.io.gfile.exists(path) else None)
    write()


def remove(path: str) -> None:
    """Removes the file `path`; inside `repairs_undone_on_error`, moves it aside until kept."""
    if _repairs is None:
        tf.io.gfile.remove(path)
        return
    trash = os.path.join(os.path.dirname(path), f".repair-{os.getpid()}")
    if trash not in _repairs.trash:
        makedirs(trash)
        _repairs.trash.append(trash)
    aside = os.path.join(trash, os.path.basename(path))
    tf.io.gfile.rename(path, aside, overwrite=True)
    _repairs.undo.append(lambda: tf.io.gfile.rename(aside, path, overwrite=True))


def rename(source: str, destination: str) -> None:
    """Renames, first removing (undoably) a file in the way."""
    if tf.io.gfile.exists(destination):
        remove(destination)
    tf.io.gfile.rename(source, destination)
    if _repairs is not None:
        _repairs.undo.append(lambda: tf.io.gfile.rename(destination, source))


def copy(source: str, destination: str) -> None:
    if tf.io.gfile.exists(destination):
        remove(destination)
    tf.io.gfile.copy(source, destination)
    if _repairs is not None:
        _repairs.undo.append(lambda: tf.io.gfile.remove(destination))


def makedirs(path: str) -> None:
    """`makedirs`; undone by removing the directories it made (empty again by then)."""
    made = []
    parent = path
    while parent and not tf.io.gfile.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent.rstrip("/"))
    tf.io.gfile.makedirs(path)
    if _repairs is not None and made:

        def remove_made() -> None:
            for directory in made:  # Innermost first.
                if "://" not in directory:  # Remote directories are prefixes: they vanish with their files.
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)

        _repairs.undo.append(remove_made)
