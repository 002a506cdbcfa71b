"""State on disk: one `tf.train.CheckpointManager` under `<model_dir>/checkpoints`.

`CheckpointManager` writes a checkpoint's files first and updates the
`checkpoint` index file last (atomically, by rename), so a write cut short
by a crash is never named latest. What it cannot guard against is a file
damaged later (a full disk, a bad copy): `set_aside_unreadable` checks the
latest checkpoint before anything restores it.
"""

from __future__ import annotations

import glob
import os
import shutil

import tensorflow as tf
from absl import logging

from engine.errors import UserError

CHECKPOINT_SUBDIR = "checkpoints"
UNREADABLE_SUBDIR = "unreadable"
_READ_ERRORS = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError,
                tf.errors.InvalidArgumentError, tf.errors.UnknownError,
                IndexError)  # the reader's "Read less bytes than requested" on a truncated file


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(model_dir, CHECKPOINT_SUBDIR)


def make_manager(
    model_dir: str, checkpoint: tf.train.Checkpoint, *, max_to_keep: int, step_counter: tf.Variable
) -> tf.train.CheckpointManager:
    return tf.train.CheckpointManager(
        checkpoint,
        directory=checkpoint_dir(model_dir),
        max_to_keep=max_to_keep,
        step_counter=step_counter,
    )


def set_aside_unreadable(model_dir: str, *, fallback: bool) -> None:
    """Makes sure the latest checkpoint can be read before it is restored.

    Without `fallback`, an unreadable latest checkpoint is an error that
    names it, and nothing on disk changes. With it, unreadable checkpoints
    are moved (not deleted) to `checkpoints/unreadable/` and the newest
    readable one becomes the latest.
    """
    directory = checkpoint_dir(model_dir)
    state = tf.train.get_checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    if state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    unreadable = []
    for path in reversed(paths):  # newest first
        problem = _read_problem(path)
        if problem is None:
            break
        if not fallback:
            raise UserError(
                f"checkpoint {path} cannot be read ({problem}); pass --restore_fallback to "
                "restore the newest older readable checkpoint, or use a new --model_dir"
            )
        logging.warning("checkpoint %s cannot be read (%s); falling back", path, problem)
        unreadable.append(path)
    if not unreadable:
        return
    readable = [p for p in paths if p not in unreadable]
    if not readable:
        raise UserError(
            f"no checkpoint in {directory} can be read (newest: {paths[-1]}); "
            "use a new --model_dir"
        )
    aside = os.path.join(directory, UNREADABLE_SUBDIR)
    os.makedirs(aside, exist_ok=True)
    for path in unreadable:
        for file in glob.glob(glob.escape(path) + ".*"):
            shutil.move(file, os.path.join(aside, os.path.basename(file)))
    tf.compat.v1.train.update_checkpoint_state(
        directory, readable[-1], all_model_checkpoint_paths=readable
    )
    logging.warning("restoring %s; unreadable checkpoints moved to %s", readable[-1], aside)


def _read_problem(path: str) -> str | None:
    """None if every tensor of the checkpoint reads back, else what failed."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except _READ_ERRORS as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return None


def restore_latest(manager: tf.train.CheckpointManager, *, directory: str | None = None) -> str | None:
    """Restores the newest checkpoint, if any, and returns its path.

    `directory` is a model_dir to read from instead of the manager's own
    (a non-chief worker writes elsewhere but resumes from the chief's).

    Every variable of the program must be in the checkpoint with the same
    shape: a checkpoint of another model is refused, not half-loaded, and
    nothing is written over it.
    """
    if directory is None:
        path = manager.latest_checkpoint
    else:
        path = tf.train.latest_checkpoint(os.path.join(directory, CHECKPOINT_SUBDIR))
    if path is None:
        return None
    try:
        status = manager.checkpoint.restore(path)
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as error:
        detail = " ".join(str(error).split())[:300]
        raise UserError(
            f"checkpoint {path} does not match this model ({detail}); "
            "use a new --model_dir or the model and flags it was trained with"
        ) from None
    return path
