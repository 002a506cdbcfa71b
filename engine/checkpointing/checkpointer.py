"""State on disk: the `Checkpointer` (one `tf.train.CheckpointManager` under
`<model_dir>/checkpoints`) and the read-only `CheckpointReader`.

`CheckpointManager` writes a checkpoint's files first and updates the
`checkpoint` index file last (atomically, by rename), so a write cut short
by a crash is never named latest. What it cannot guard against is a file
damaged later (a full disk, a bad copy): `set_aside_unreadable` checks the
latest checkpoint before anything restores it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from engine import model_dir as model_dir_lib
from engine.checkpointing import discovery, repairs, reshard
from engine.checkpointing.background import BackgroundWriter, HostCopy
from engine.errors import UserError, one_line
from engine.logger import logger
from engine.options import CheckpointOptions
from engine.variables import all_variables, random_state_variables

CHECKPOINT_SUBDIR = "checkpoints"
UNREADABLE_SUBDIR = "unreadable"
# The settings a checkpoint's optimizer state depends on, by flag (see `check_settings`).
SETTINGS_FILE = "settings.json"


# The key of the model's random state (`engine.variables.random_state_variables`) in checkpoints.
RANDOM_STATE_KEY = "random_state"


def checkpoint_of(
    model: Any, global_step: tf.Variable, optimizers: Mapping[str, keras.optimizers.Optimizer]
) -> tf.train.Checkpoint:
    """What a checkpoint holds: the model, the global step, the optimizer(s) and the model's
    random state (the seed generators of Dropout and the other random layers, which the
    model's own tracking leaves out), so that a resumed run draws what the uninterrupted
    one draws. One optimizer keeps the key "optimizer" that existing checkpoints use."""
    optimizer_state: dict[str, Any] = (
        {"optimizer": next(iter(optimizers.values()))}
        if len(optimizers) == 1
        else {"optimizers": dict(optimizers)}
    )
    random_state = random_state_variables(model)
    if random_state:  # Only where there is some: checkpoints of models without it keep their layout.
        optimizer_state[RANDOM_STATE_KEY] = random_state
    checkpoint = tf.train.Checkpoint(model=model, global_step=global_step, **optimizer_state)
    refuse_unsaved_variables(model, checkpoint)
    return checkpoint


def refuse_unsaved_variables(model: Any, checkpoint: tf.train.Checkpoint) -> None:
    """A model variable the checkpoint cannot reach is refused before anything is saved.

    `tf.train.Checkpoint` saves what it reaches through tracked attributes. A
    Keras 3 layer that keeps its variables in a Python list or dict (`self.tables =
    [self.add_weight(...)]`) trains them, yet its checkpoints leave them out: a resumed
    run would silently start them over from their initial values.
    """
    reachable = {id(node) for node in tf.train.TrackableView(checkpoint).descendants()}
    lost = [variable for variable in all_variables(model) if id(variable) not in reachable]
    if lost:
        names = ", ".join(repr(getattr(v, "path", None) or v.name) for v in lost[:3])
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        raise UserError(
            f"the model's variable(s) {names}{more} would be left out of its checkpoints: "
            "tf.train.Checkpoint saves a layer's variables through its attributes, and these are "
            "kept in a list or dict (or outside the model); assign each variable to an attribute "
            "of its layer (e.g. setattr(self, f'table_{i}', self.add_weight(...)))"
        )


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
    readable one becomes the latest, whether the state file lists it or only
    the directory holds it (a state file naming only missing checkpoints).
    """
    directory = checkpoint_dir(model_dir)
    discovery.recover_state(directory)
    state = discovery.checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    if state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    if fallback:  # Every checkpoint there is, by step: the state file may list only missing ones.
        paths = sorted(set(paths) | set(discovery.scan_checkpoints(directory)), key=_step_of)
    unreadable = []
    for path in reversed(paths):  # newest first
        problem = discovery.read_problem(path)
        if problem is None:
            break
        if not fallback:
            raise UserError(
                f"checkpoint {path} cannot be read ({problem}); pass `restore_fallback=True` to "
                "restore the newest older readable checkpoint, or use a new `model_dir`"
            )
        logger.warning("checkpoint %s cannot be read (%s); falling back", path, problem)
        unreadable.append(path)
    if not unreadable:
        return
    readable = [p for p in paths if p not in unreadable]
    if not readable:
        raise UserError(f"no checkpoint in {directory} can be read (newest: {paths[-1]}); use a new `model_dir`")
    aside = os.path.join(directory, UNREADABLE_SUBDIR)
    repairs.makedirs(aside)
    prefixes = {os.path.basename(path) + "." for path in unreadable}
    for name in tf.io.gfile.listdir(directory):  # Listed, not globbed: the name may hold pattern characters.
        if any(name.startswith(prefix) for prefix in prefixes):
            repairs.rename(os.path.join(directory, name), os.path.join(aside, name))
    discovery.write_state(directory, readable[-1], readable)
    logger.warning("restoring %s; unreadable checkpoints moved to %s", readable[-1], aside)


def _step_of(path: str) -> int:
    match = re.search(r"-(\d+)$", path)
    return int(match.group(1)) if match else -1


def restore_latest(
    manager: tf.train.CheckpointManager, *, directory: str | None = None, fresh_optimizer: bool = False
) -> str | None:
    """Restores the newest checkpoint, if any, and returns its path.

    `directory` is a model_dir to read from instead of the manager's own
    (a non-chief worker writes elsewhere but resumes from the chief's).
    `fresh_optimizer` restores everything but the optimizer (`reset_optimizer`):
    its slots start over, its step count continues from the global step.

    Every variable of the program must be in the checkpoint with the same
    shape: a checkpoint of another model is refused, not half-loaded, and
    nothing is written over it.
    """
    if directory is None:
        path = manager.latest_checkpoint
    else:
        path = discovery.latest_checkpoint(os.path.join(directory, CHECKPOINT_SUBDIR))
    if path is None:
        return None
    checkpoint = manager.checkpoint
    try:
        partial = "both" if fresh_optimizer else ""
        with reshard.translated(path, checkpoint, partial=partial) as (source, options):  # Another shard count.
            _restore(checkpoint, source, fresh_optimizer=fresh_optimizer, options=options)
    except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as error:
        detail = one_line(error, 300)
        raise UserError(
            f"checkpoint {path} does not match this model ({detail}); "
            "use a new `model_dir` or the model and settings it was trained with"
        ) from None
    except tf.errors.OpError as error:  # Damaged after the readability check, or never checked.
        detail = one_line(error, 200)
        raise UserError(
            f"checkpoint {path} cannot be read ({type(error).__name__}: {detail}); pass "
            "`restore_fallback=True` to restore the newest older readable checkpoint, or use a new `model_dir`"
        ) from None
    return path


def _restore(
    checkpoint: tf.train.Checkpoint,
    path: str,
    *,
    fresh_optimizer: bool,
    options: tf.train.CheckpointOptions | None = None,
) -> None:
    """`restore_latest`'s restore of `path` into `checkpoint`, every value matched."""
    if fresh_optimizer:
        # The data position (engine.data.DataPosition), where checkpointed, is not optimizer state.
        kept = {name: getattr(checkpoint, name) for name in ("data_position",) if hasattr(checkpoint, name)}
        partial = tf.train.Checkpoint(model=checkpoint.model, global_step=checkpoint.global_step, **kept)
        partial.restore(path, options=options).expect_partial().assert_existing_objects_matched()
        optimizers = getattr(checkpoint, "optimizers", None) or {"": checkpoint.optimizer}
        for optimizer in optimizers.values():
            optimizer.iterations.assign(checkpoint.global_step)  # Schedules continue.
        return
    status = checkpoint.restore(path, options=options)
    status.assert_existing_objects_matched()
    # Values of the checkpoint left over (Adam's slots restored into SGD) are state lost.
    status.assert_consumed()


def check_settings(model_dir: str, settings: Mapping[str, str], *, flags_may_change: bool = False) -> None:
    """Refuses to resume with settings that change what the checkpoint's optimizer
    state means, naming the setting (`settings` maps a flag's name to its value; the
    message spells it as `name=value`, which the command line prints as the flag).

    The settings of the run that wrote the checkpoints are kept in
    `checkpoints/settings.json` (`record_settings`); a model_dir without it
    (older runs) is checked by the restore alone.
    """
    directory = checkpoint_dir(model_dir)
    if flags_may_change or discovery.checkpoint_state(directory) is None:
        return
    saved = model_dir_lib.read_json(
        os.path.join(directory, SETTINGS_FILE), what="the settings of the checkpoints"
    )
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise UserError(
            f"{os.path.join(directory, SETTINGS_FILE)} is damaged (not a JSON object); "
            "restore it or move it away"
        )
    changed = [
        (flag, saved[flag], value) for flag, value in settings.items() if flag in saved and saved[flag] != value
    ]
    if changed:
        flag, old, new = changed[0]
        raise UserError(
            f"`{flag}={new}` differs from `{flag}={old}` that the checkpoints in {directory} were "
            f"trained with; pass `{flag}={old}` to resume, `reset_optimizer=True` to keep the weights "
            "and start fresh optimizer state, or a new `model_dir`"
        )


def recorded_settings(model_dir: str) -> dict:
    """The settings `record_settings` wrote ({} when there are none)."""
    saved = model_dir_lib.read_json(
        os.path.join(checkpoint_dir(model_dir), SETTINGS_FILE), what="the settings of the checkpoints"
    )
    return saved if isinstance(saved, dict) else {}


def record_settings(model_dir: str, settings: Mapping[str, str]) -> None:
    """Writes the settings `check_settings` compares against (the chief, before training)."""
    model_dir_lib.write_json(os.path.join(checkpoint_dir(model_dir), SETTINGS_FILE), settings)


class Checkpointer:
    """Saves and restores a run's checkpoints in `<model_dir>/checkpoints`.

    Built before anything is written: the model_dir's name, that every
    model variable is reachable by `checkpoint`, and that the latest
    checkpoint can be read (or, with `restore_fallback`, the newest one that
    can) are checked here.

    Args:
      model_dir: where checkpoints are written.
      checkpoint: what they hold (model, global_step, optimizer(s)).
      model: the model whose every variable the checkpoint must reach.
      step_counter: numbers each checkpoint (`ckpt-<step>`).
      options: how many to keep, how to restore, and whether to write in the background.
    """

    def __init__(
        self,
        model_dir: str,
        checkpoint: tf.train.Checkpoint,
        *,
        model: Any,
        step_counter: tf.Variable,
        options: CheckpointOptions | None = None,
    ):
        options = options or CheckpointOptions()
        model_dir_lib.check_name(model_dir)
        model_dir_lib.check_no_links(model_dir)  # Before the repairs below: nothing through a link.
        _check_checkpointed(checkpoint, model)
        set_aside_unreadable(model_dir, fallback=options.restore_fallback)
        self.options = options
        self.model = model
        self.model_dir = model_dir
        # Removed, replaced or made unwritable mid-run: one line at the next save, not a new empty model_dir.
        self._watch = model_dir_lib.DirectoryWatch(model_dir, checkpoint_dir(model_dir))
        self._checkpoint = checkpoint
        self._copy: HostCopy | None = None
        self._writer: BackgroundWriter | None = None
        if options.async_checkpoint:
            self._copy = HostCopy(checkpoint)
            unsupported = self._copy.unsupported()
            if unsupported is not None:
                logger.warning(
                    "saving checkpoints synchronously: %s cannot be copied for a background write", unsupported
                )
                self._copy = None
        # Asynchronous: the manager of the copy's twin, which the writer thread saves through.
        self.manager = make_manager(
            model_dir,
            checkpoint if self._copy is None else self._copy.twin,
            max_to_keep=options.max_checkpoints,
            step_counter=step_counter,
        )
        if self._copy is not None:
            self._writer = BackgroundWriter(self.manager)

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        """What the checkpoints hold, for saves of its own (the best checkpoint): synchronous."""
        return self._checkpoint

    def track(self, name: str, trackable: Any) -> None:
        """Adds `trackable` under `name` to what every later checkpoint holds and restores (the
        data position, with rollback): to the checkpoint and, saving in the background, to the
        twin the writer saves and restores through (otherwise it would be left out, silently)."""
        setattr(self._checkpoint, name, trackable)
        if self._copy is not None:
            setattr(self._copy.twin, name, trackable)

    @property
    def writes_in_background(self) -> bool:
        return self._writer is not None

    @property
    def latest(self) -> str | None:
        """The newest complete checkpoint; waits for a write under way (its error stays for `wait`)."""
        if self._writer is not None:
            self._writer.join()
        return self.manager.latest_checkpoint

    @property
    def restore_path(self) -> str | None:
        """The checkpoint `restore()` would restore (of `options.restore_dir` if set), or None."""
        if self.options.restore_dir is None:
            return self.latest
        return discovery.latest_checkpoint(os.path.join(self.options.restore_dir, CHECKPOINT_SUBDIR))

    def restore(self) -> str | None:
        """Restores the newest checkpoint (of `options.restore_dir` if set); its path, or None."""
        self.wait()
        return restore_latest(
            self.manager, directory=self.options.restore_dir, fresh_optimizer=self.options.reset_optimizer
        )

    def save(self, step: int, *, background: bool = True) -> str:
        """Writes `ckpt-<step>`; refuses weights holding NaN/Inf and a full disk, keeping the latest.

        With `async_checkpoint` (and `background`), returns once the variables are copied; the
        files are written in the background and the state file names them once complete. `wait`
        (or the next save) waits for them and raises what the write met, as a synchronous save
        would have. `background=False` writes in this thread all the same.
        """
        if not _all_finite(self.model):
            raise UserError(
                f"the weights hold NaN or Inf at step {step}; not saved, the latest checkpoint "
                f"({self.latest or 'none'}) is kept"
            )
        self.wait()  # The copy must not change under a write still under way.
        self._check_directories(step)
        directory = self.manager.directory
        discovery.set_aside_unlisted(directory, step, listed=self.manager.checkpoints)
        if background and self._writer is not None and self._copy is not None:
            self._copy.take()
            self._writer.start(step)
            return os.path.join(directory, f"ckpt-{step}")
        # Saving in the background, the manager saves the copy's twin: here it writes the originals.
        originals = self._copy.originals_saved() if self._copy is not None else contextlib.nullcontext()
        try:
            with originals, discovery.partial_removed_on_error(os.path.join(directory, f"ckpt-{step}")):
                path = self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as error:
            failed = self._write_failed(step, error)
            if failed is None:
                raise
            raise failed from None
        self._watch.note()  # The first save makes the directories.
        logger.info("Saved checkpoint %s", path)
        return path

    def wait(self) -> None:
        """Returns once no checkpoint is being written; raises the error a background write
        met (a full disk: the one line a synchronous save gives)."""
        if self._writer is None:
            return
        failed = self._writer.result()
        if failed is None:
            return
        step, error = failed
        written = self._write_failed(step, error) if isinstance(error, (tf.errors.OpError, OSError)) else None
        if written is None:
            raise error
        raise written from None

    def _write_failed(self, step: int, error: BaseException) -> UserError | None:
        """A write that failed for a full disk, or because the model_dir was removed, replaced
        or made unwritable, as one line naming the latest checkpoint (which stays the latest);
        None for any other error. The write removed its own partial folder."""
        directory = self.manager.directory
        message = model_dir_lib.disk_full_message(directory, error)
        if message is None:
            problem = self._watch.problem(error)
            return None if problem is None else UserError(self._not_saved(step, problem))
        discovery.remove_partial_checkpoints(self.model_dir)  # Any other write's the disk cut short.
        return UserError(
            f"checkpoint at step {step} not saved: {message}; the latest checkpoint "
            f"({self._latest_on_disk() or 'none'}) is kept"
        )

    def _check_directories(self, step: int) -> None:
        """Refuses to save into a model_dir that was removed, replaced or made unwritable since
        the run began (TensorFlow would make a new, empty one)."""
        self._watch.note()
        problem = self._watch.problem()
        if problem is not None:
            raise UserError(self._not_saved(step, problem))

    def _latest_on_disk(self) -> str | None:
        """The checkpoint a rerun continues from: the one the state file names. After a write
        that failed between a checkpoint's files and the state file (the model_dir made
        read-only just then), the manager already counts the new checkpoint; a rerun does not."""
        return discovery.latest_checkpoint(self.manager.directory)

    def _not_saved(self, step: int, problem: str) -> str:
        latest = self._latest_on_disk()
        if latest is not None and discovery.read_problem(latest) is None:
            kept = f"the latest checkpoint ({latest}) is kept: rerun to continue from it"
        else:
            kept = "no checkpoint of the run is left there: rerun to start over, with a `model_dir` that stays"
        return f"checkpoint at step {step} not saved: {problem}; {kept}"


class CheckpointVanished(Exception):
    """The checkpoint's files went away (rotation) before or while it was read."""


class CheckpointReader:
    """Restores checkpoints another process writes, read-only.

    A plain `tf.train.Checkpoint.read`: no `CheckpointManager`, which could
    rotate or set aside the writer's files, and no writer lock. For the
    checkpoint evaluator, which reads while a trainer writes and rotates.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint):
        self.checkpoint = checkpoint
        # Made now so each read restores it at once: made later (by a best checkpoint's first save),
        # it would be restored then, from a checkpoint rotation may have deleted since.
        _ = checkpoint.save_counter

    def read(self, path: str, *, strict: bool) -> None:
        """Restores `path` into the objects at once.

        Raises:
          CheckpointVanished: its files went away (rotation) and not `strict`.
          UserError: it cannot be read, or it does not match the objects.
        """
        try:
            with reshard.translated(path, self.checkpoint, partial="leftover") as (source, options):
                status = self.checkpoint.read(source, options=options)  # Tables of another shard count: re-cut.
                status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError, IndexError) as error:  # IndexError: truncated
            if files_gone(path) and not strict:
                raise CheckpointVanished(f"{path}: {type(error).__name__}") from None
            detail = one_line(error, 300)
            if files_gone(path) or not isinstance(
                error, (AssertionError, ValueError, tf.errors.InvalidArgumentError)
            ):
                raise UserError(f"checkpoint {path} cannot be read ({type(error).__name__}: {detail})") from None
            raise UserError(
                f"checkpoint {path} does not match this model ({detail}); pass the "
                "model and settings it was trained with"
            ) from None
        status.expect_partial()


def files_gone(path: str) -> bool:
    """Whether a checkpoint's index or data files are missing, as rotation leaves them."""
    return not (tf.io.gfile.exists(path + ".index") and tf.io.gfile.glob(path + ".data-*"))


def _check_checkpointed(checkpoint: tf.train.Checkpoint, model: Any) -> None:
    """Every model variable must be reachable by the checkpoint, or a resume loses it silently."""
    reachable = {id(node) for node in tf.train.TrackableView(checkpoint).descendants()}
    missing = [v for v in all_variables(model) if id(v) not in reachable]
    if missing:
        raise UserError(
            f"{len(missing)} variable(s) of the model ({type(model).__name__}) would not be checkpointed, "
            f"e.g. {missing[0].name!r}: keep them as attributes of the model (or of its tf.Module/Keras "
            "parts), not in plain Python containers the checkpoint cannot see"
        )


def _all_finite(model: Any) -> bool:
    """Whether every floating-point weight of the model is finite (checked before each save)."""
    values = []
    for variable in all_variables(model):
        if isinstance(variable, keras.Variable):
            variable = variable.value
        if variable.dtype.is_floating:
            values.append(tf.reduce_all(tf.math.is_finite(variable)))
    return bool(tf.reduce_all(values)) if values else True
