"""The one exception type for mistakes a user can fix (flags, data, model_dir).

`engine.main` prints these as a single line and exits non-zero; anything else
is a bug in the engine and keeps its traceback.
"""

# The exit status of every command-line entry point (engine.main, engine.launch,
# engine.server) for a UserError; engine.launch never restarts a task that exits with it.
USER_ERROR_EXIT = 2
# The exit status of a task whose peer stopped answering mid-run (EX_UNAVAILABLE): not the
# task's own mistake, so engine.launch --max_restarts restarts the cluster on it.
PEER_LOST_EXIT = 69


def one_line(error: BaseException | str, limit: int | None = None) -> str:
    """`error`'s text on one line (TensorFlow's messages span several), cut to `limit` characters."""
    text = " ".join(str(error).split())
    return text if limit is None else text[:limit]


class UserError(Exception):
    """A bad input: the message says what is wrong and what to do."""

    # Raised while a step is traced, it must reach the user as the one line it is: AutoGraph
    # leaves exceptions with this attribute alone (engine.compat.AUTOGRAPH_PASS_THROUGH, tested
    # in tests/unit/test_compat.py; this module imports no TensorFlow, so the name is spelled here).
    ag_pass_through = True


class PeerLostError(UserError):
    """A peer task stopped answering mid-run (frozen, partitioned or dead): one line, but an
    exit status that asks for a rerun instead of a fix."""

    exit_status = PEER_LOST_EXIT


class NonFiniteLossError(UserError):
    """Training produced a NaN or Inf loss and was stopped (on_nonfinite="stop")."""


class DataExhaustedError(UserError):
    """The training data ended before the target step.

    Raised by `Trainer.train` after it saved a checkpoint at the last
    completed step (`trainer.step`, which equals the updates applied); the
    message says to `.repeat()` the dataset. Catch it to treat a finite
    dataset as one pass.
    """

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step
