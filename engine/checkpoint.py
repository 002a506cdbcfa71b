"""State on disk: one `tf.train.CheckpointManager` under `<model_dir>/checkpoints`.

`CheckpointManager` writes a checkpoint's files first and updates the
`checkpoint` index file last, so a write cut short is never named latest.
"""

from __future__ import annotations

import os

import tensorflow as tf

from engine.errors import UserError

CHECKPOINT_SUBDIR = "checkpoints"


def make_manager(
    model_dir: str, checkpoint: tf.train.Checkpoint, *, max_to_keep: int, step_counter: tf.Variable
) -> tf.train.CheckpointManager:
    return tf.train.CheckpointManager(
        checkpoint,
        directory=os.path.join(model_dir, CHECKPOINT_SUBDIR),
        max_to_keep=max_to_keep,
        step_counter=step_counter,
    )


def restore_latest(manager: tf.train.CheckpointManager, *, directory: str | None = None) -> str | None:
    """Restores the newest checkpoint, if any, and returns its path.

    `directory` is a model_dir to read from instead of the manager's own
    (a non-chief worker writes elsewhere but resumes from the chief's).

    Every variable of the program must be in the checkpoint with the same
    shape: a checkpoint of another model is refused, not half-loaded.
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
    except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError) as error:
        raise UserError(
            f"checkpoint {path} cannot be read ({type(error).__name__}); "
            "it may be truncated: move it away or use a new --model_dir"
        ) from None
    return path
