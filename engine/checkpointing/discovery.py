"""The checkpoints in a directory: finding, reading and listing them, their state file, and
the writes cut short.

A checkpoint directory (`<model_dir>/checkpoints`, `<model_dir>/best`) holds `ckpt-N` files
and a state file naming them. Found by listing, never by a pattern (a model_dir's name may
hold pattern characters), and read by their names in this directory, so a copied model_dir
resumes from its own files. A deleted or damaged state file made a rerun start over on top
of the saved checkpoints: `recover_state` names them again. A write cut short (kill -9, a
full disk) leaves a `ckpt-N_temp` folder: `remove_partial_checkpoints` removes it at the
next start, under the model_dir's writer lock (`engine.model_dir`). While that folder is there,
the `ckpt-N.*` files beside it may be half written: TensorFlow moves the data files out of the
folder, then writes `ckpt-N.index` in place (not by rename), and removes the folder last. Such
a `ckpt-N` counts as a checkpoint only if it reads back whole (`scan_checkpoints`), and
otherwise goes with its folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator

import tensorflow as tf

from engine.checkpointing import repairs
from engine.errors import UserError, one_line
from engine.logger import logger
from engine.model_dir import (
    CHECKPOINT_SUBDIRECTORIES,
    DAMAGED_STATE_SUFFIX,
    STATE_FILE,
    SUPERSEDED_SUBDIR,
    holds_writer_lock,
    is_remote,
    lock_key,
    remove_tree,
    write_atomically,
    writer_lock,
)

_CHECKPOINT_INDEX = re.compile(r"^ckpt-(\d+)\.index$")


def scan_checkpoints(directory: str) -> list[str]:
    """Prefixes of every `ckpt-N` with an index file in `directory`, oldest first; one whose
    `ckpt-N_temp` folder is still beside it only if it reads back whole (its write was cut
    short, perhaps in the middle of its index: `_unfinished`).

    Lists the directory instead of matching a pattern, so it is right for any
    directory name.
    """
    if not tf.io.gfile.isdir(directory):
        return []
    names = [name.rstrip("/") for name in tf.io.gfile.listdir(directory)]
    folders = {name[: -len("_temp")] for name in names if _PARTIAL_CHECKPOINT.match(name)}
    numbered = []
    for name in names:
        match = _CHECKPOINT_INDEX.match(name)
        if match:
            prefix = name[: -len(".index")]
            path = os.path.join(directory, prefix)
            if prefix not in folders or not _unfinished(path):
                numbered.append((int(match.group(1)), path))
    return [path for _, path in sorted(numbered)]


def _unfinished(path: str) -> bool:
    """Whether the checkpoint `path` (`<dir>/ckpt-N`, its `ckpt-N_temp` folder beside it) is a
    write cut short: TensorFlow moves the data files out of the folder, writes the index in
    place (not by rename) and removes the folder last, so only reading it back tells."""
    return read_problem(path) is not None


def read_problem(path: str) -> str | None:
    """None if every tensor of the checkpoint at `path` reads back, else what failed.

    Any `OpError` counts: a truncated or zeroed index, a checksum mismatch or
    a deleted data file each surface as a different one.
    """
    try:
        # Not tf.train.load_checkpoint: on ram:// it takes the prefix for a directory.
        reader = tf.compat.v1.train.NewCheckpointReader(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, IndexError, ValueError) as error:  # IndexError: a short read
        return f"{type(error).__name__}: {one_line(error, 200)}"
    return None


def checkpoint_state(directory: str):
    """`tf.train.get_checkpoint_state`, with every path read as a checkpoint of
    `directory` itself, and None also for a state file it cannot parse (it
    returns None for some damage and raises ValueError for other).

    A state file names checkpoints of its own directory: read by their names,
    a copied or moved model_dir resumes from its own files even when an
    older version wrote absolute paths there (which reached the original's).
    """
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (ValueError, tf.errors.OpError):
        return None
    if state is None:
        return None
    if state.model_checkpoint_path:
        state.model_checkpoint_path = os.path.join(directory, os.path.basename(state.model_checkpoint_path))
    paths = [os.path.join(directory, os.path.basename(path)) for path in state.all_model_checkpoint_paths]
    del state.all_model_checkpoint_paths[:]
    state.all_model_checkpoint_paths.extend(paths)
    return state


def latest_checkpoint(directory: str) -> str | None:
    """`tf.train.latest_checkpoint`, read as `checkpoint_state` reads (in `directory`, by name)."""
    state = checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return None
    path = state.model_checkpoint_path
    return path if tf.io.gfile.exists(path + ".index") else None


def listed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of each checkpoint `directory`'s state file names whose index is there,
    oldest first: what a reader beside a live trainer may read. The trainer names a checkpoint
    there only once its files are complete (`CheckpointManager` writes the state file after
    the files, by rename), so a checkpoint being written is never listed; one being deleted
    by rotation may still be (its reader must survive that: `files_gone`)."""
    state = checkpoint_state(directory) if tf.io.gfile.isdir(directory) else None
    if state is None:
        return []
    paths = {*state.all_model_checkpoint_paths, state.model_checkpoint_path} - {""}
    numbered = ((_step_in_name(path), path) for path in paths)
    return sorted((step, path) for step, path in numbered if step >= 0 and tf.io.gfile.exists(path + ".index"))


def _step_in_name(path: str) -> int:
    """N of a `.../ckpt-N` prefix; -1 for another name."""
    match = re.search(r"-(\d+)$", path)
    return int(match.group(1)) if match else -1


def write_state(directory: str, latest: str, every: list[str]) -> None:
    """Writes `directory`'s state file naming checkpoints relative to it (by name),
    as `tf.train.CheckpointManager` does, so the model_dir stays portable.

    Written here, not by `tf.compat.v1.train.update_checkpoint_state`: given a
    name in a directory that is not absolute (ram://, a relative `model_dir`)
    it writes `../../ckpt-3`.
    """
    names = [os.path.basename(path) for path in every]
    if not names or names[-1] != os.path.basename(latest):
        names.append(os.path.basename(latest))
    text = f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
        f'all_model_checkpoint_paths: "{name}"\n' for name in names
    )
    path = os.path.join(directory, STATE_FILE)
    repairs.write(path, lambda: write_atomically(path, text))


def names_other_directories(directory: str) -> bool:
    """Whether `directory`'s state file holds paths rather than names (an older
    version wrote absolute paths after recovering it)."""
    try:
        with tf.io.gfile.GFile(os.path.join(directory, STATE_FILE), "r") as handle:
            text = handle.read()
    except (tf.errors.OpError, UnicodeDecodeError):
        return False
    return any("/" in path for path in re.findall(r'checkpoint_paths?: "(.*)"', text))


def recover_state(directory: str) -> str | None:
    """Makes the state file of `directory` name its checkpoints again when it
    is missing or damaged while checkpoint files are there; returns what it did.

    Without this, `CheckpointManager` sees no checkpoint, the run starts from
    step 0 and overwrites `ckpt-N` as it reaches N. The newest readable
    checkpoint found by listing the directory becomes the latest; a damaged
    state file is kept beside as `checkpoint.damaged`. Raises UserError when
    checkpoint files are there but none can be read.
    """
    found = scan_checkpoints(directory)
    state_path = os.path.join(directory, STATE_FILE)
    state = checkpoint_state(directory)
    if state is not None and state.model_checkpoint_path:
        if names_other_directories(directory):
            write_state(directory, state.model_checkpoint_path, list(state.all_model_checkpoint_paths))
            logger.warning(
                "the checkpoint state file %s named checkpoints by absolute paths (an older version); "
                "rewrote it to name the checkpoints of %s itself, wherever it is now",
                state_path,
                directory,
            )
        return None
    if not found:
        if state is None and tf.io.gfile.exists(state_path):  # Names nothing: set aside, start afresh.
            repairs.rename(state_path, state_path + DAMAGED_STATE_SUFFIX)
            logger.warning(
                "the checkpoint state file %s is damaged and there is no checkpoint; kept as %s",
                state_path,
                state_path + DAMAGED_STATE_SUFFIX,
            )
        return None
    readable = [path for path in found if read_problem(path) is None]
    if not readable:
        raise UserError(
            f"{directory} holds checkpoints ({os.path.basename(found[-1])} the newest) but its "
            f"state file {STATE_FILE!r} is missing or damaged and none of them can be read; "
            "use a new `model_dir`"
        )
    what = "missing"
    if tf.io.gfile.exists(state_path):
        what = "damaged"
        repairs.rename(state_path, state_path + DAMAGED_STATE_SUFFIX)
    write_state(directory, readable[-1], readable)
    message = (
        f"the checkpoint state file {state_path} was {what}; found {len(found)} checkpoint(s) "
        f"by listing the directory and continue from the newest readable, {readable[-1]}"
    )
    logger.warning("%s", message)
    return message


def set_aside_unlisted(directory: str, number: int, *, listed: list[str]) -> None:
    """Moves the files of `ckpt-<number>` to `superseded/` when they exist but the
    state file does not list them (a crash between a save and its state update,
    or an older state file put back), so that the save about to write that
    name never overwrites a checkpoint."""
    prefix = f"ckpt-{number}"
    if prefix in {os.path.basename(path) for path in listed}:
        return
    if not tf.io.gfile.exists(os.path.join(directory, prefix + ".index")):
        return
    aside = os.path.join(directory, SUPERSEDED_SUBDIR, time.strftime("%Y%m%dT%H%M%S"))
    tf.io.gfile.makedirs(aside)
    for name in tf.io.gfile.listdir(directory):
        if name.startswith(prefix + "."):
            tf.io.gfile.rename(os.path.join(directory, name), os.path.join(aside, name))
    logger.warning(
        "%s existed but the checkpoint state did not list it; moved it to %s before saving a new %s",
        os.path.join(directory, prefix),
        aside,
        prefix,
    )


# ------------------------------------------------- checkpoint writes cut short

# TensorFlow writes `ckpt-N` as `ckpt-N_temp/part-<i>-of-<n>.{index,data-...}` (each file first
# as `<name>.tempstate<random>`), then merges the parts into `ckpt-N.*` and removes the folder:
# a folder left is a write cut short (kill -9, a full disk) and holds no complete checkpoint.
_PARTIAL_CHECKPOINT = re.compile(r"^ckpt-\d+_temp$")
_PARTIAL_PART = re.compile(r"^part-\d+-of-\d+\.(index|data-\d+-of-\d+)(\.tempstate\d+)?$")
# The partial folders of background writes under way in this process (a Trainer made while
# another one's write runs must not remove it).
_writes_under_way: set[str] = set()


@contextlib.contextmanager
def partial_removed_on_error(prefix: str) -> Iterator[None]:
    """A checkpoint write to `prefix` (a path) in the block: its partial folder (`<prefix>_temp`)
    is this process's while the block runs, and is removed if the block raises (a full disk, an
    unwritable directory), so a failed save leaves nothing behind."""
    folder = prefix.rstrip("/") + "_temp"
    key = lock_key(folder)
    _writes_under_way.add(key)
    try:
        yield
    except BaseException:
        _remove_partial(folder)
        raise
    finally:
        _writes_under_way.discard(key)


def partial_checkpoints(model_dir: str) -> list[str]:
    """The partial folders (`ckpt-N_temp`) in the model_dir's checkpoint directories that no
    write of this process is filling, found by listing (never a pattern: the name may hold
    pattern characters)."""
    found = []
    for subdirectory in CHECKPOINT_SUBDIRECTORIES:
        directory = os.path.join(model_dir, subdirectory)
        if not tf.io.gfile.isdir(directory):
            continue
        for name in sorted(tf.io.gfile.listdir(directory)):
            name = name.rstrip("/")
            path = os.path.join(directory, name)
            if _PARTIAL_CHECKPOINT.match(name) and lock_key(path) not in _writes_under_way:
                found.append(path)
    return found


def remove_partial_checkpoints(model_dir: str) -> None:
    """Removes the partial folders that checkpoint writes cut short (kill -9, a full disk)
    left in the model_dir (`partial_checkpoints`): at every start.

    Only under the model_dir's writer lock, where a live run's write in progress looks the
    same: this process's own (`writer_lock`: the command line), else taken for the moment of
    the removal (the library's Trainer holds none); when another run holds it, nothing is
    removed. Only the engine's own names: a folder holding anything but TensorFlow's part
    files, or a symbolic link, is left with a warning.
    """
    found = partial_checkpoints(model_dir)
    if not found:
        return
    if holds_writer_lock(model_dir):
        for path in found:
            _remove_partial(path, warn=True)
        return
    if is_remote(model_dir):  # No lock to take: a live run's writes look the same.
        logger.warning(
            "left %s: `model_dir=%r` has no writer lock to tell a write cut short from one under way",
            ", ".join(found),
            model_dir,
        )
        return
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(writer_lock(model_dir))
        except UserError as busy:
            logger.warning("left %s, which may be the write of a run under way: %s", ", ".join(found), busy)
            return
        for path in partial_checkpoints(model_dir):  # Again: the other run may have ended a write.
            _remove_partial(path, warn=True)


def _remove_partial(path: str, *, warn: bool = False) -> None:
    """Removes the partial folder `path` if it holds only TensorFlow's part files (and is not a link)."""
    if is_remote(path):
        if not tf.io.gfile.isdir(path):
            return
        names = [name.rstrip("/") for name in tf.io.gfile.listdir(path)]
    else:
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # A symbolic link (to anywhere) is not ours.
                if warn:
                    logger.warning("left %s: it is not a directory the engine wrote", path)
                return
            names = os.listdir(path)
        except FileNotFoundError:
            return
    foreign = [name for name in names if not _PARTIAL_PART.match(name)]
    if foreign:
        if warn:
            logger.warning(
                "left %s, a checkpoint write cut short: it also holds %s, which the engine does not write",
                path,
                ", ".join(sorted(foreign)[:3]),
            )
        return
    if warn:
        logger.warning("removing %s, left by a checkpoint write that did not finish", path)
    _remove_unfinished_files(path, warn=warn)  # Before the folder, which tells that they are unfinished.
    if is_remote(path):
        remove_tree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


_CHECKPOINT_FILE = re.compile(r"^(ckpt-\d+)\.(index|data-\d+-of-\d+)$")


def _remove_unfinished_files(folder: str, *, warn: bool) -> None:
    """Removes the `ckpt-N.*` files the write that left `folder` (`<dir>/ckpt-N_temp`) had
    already put beside it (its data files, a half-written index) when they do not read back
    as a checkpoint and the state file of `<dir>` does not name `ckpt-N`. A complete one (a
    kill in the instant between its index and the folder's removal) stays, for the listing
    (`recover_state`) or the next save of that step (`set_aside_unlisted`) to find."""
    directory, name = os.path.split(folder.rstrip("/"))
    prefix = name[: -len("_temp")]
    state = checkpoint_state(directory)
    named = set() if state is None else {state.model_checkpoint_path, *state.all_model_checkpoint_paths}
    path = os.path.join(directory, prefix)
    if path in named or (tf.io.gfile.exists(path + ".index") and not _unfinished(path)):
        return
    files = [file for file in tf.io.gfile.listdir(directory) if _file_of(file, prefix)]
    if files and warn:
        logger.warning("removing %s of the same write: it does not read back whole", ", ".join(sorted(files)))
    for file in files:
        with contextlib.suppress(tf.errors.NotFoundError):
            tf.io.gfile.remove(os.path.join(directory, file))


def _file_of(file: str, prefix: str) -> bool:
    match = _CHECKPOINT_FILE.match(file)
    return match is not None and match.group(1) == prefix
