"""The one exception type for mistakes a user can fix (flags, data, model_dir).

`engine.main` prints these as a single line and exits non-zero; anything else
is a bug in the engine and keeps its traceback.
"""

# The exit statuses of the commands (engine.main, engine.launch, engine.server), for a
# scheduler to act on by status alone: the table in docs/several-machines.md#exit-statuses
# (tests/unit/launch/test_exit_statuses.py holds the two together). 0 is done, 1 a bug (a traceback),
# 128 + N stopped by signal N after saving (129 SIGHUP, 130 SIGINT, 143 SIGTERM).

# A UserError (bad flags, config, data, model_dir, checkpoint): every rerun fails alike, so
# neither engine.launch nor a scheduler should run it again.
USER_ERROR_EXIT = 2
# engine.launch spent its --max_restarts (or --max_worker_restarts) and the run failed again:
# it was retried already, a person should look before anything reruns it.
RESTARTS_SPENT_EXIT = 3
# A task whose peer stopped answering mid-run (EX_UNAVAILABLE): not the task's own mistake,
# so engine.launch --max_restarts restarts the cluster on it, and a scheduler may too.
PEER_LOST_EXIT = 69
# A worker that stopped, checkpoint saved, because a peer was signalled (EX_TEMPFAIL):
# requeue it, as the signalled task's 128 + N.
STOPPED_BY_PEER_EXIT = 75


def final_status(status: int, cause: str, *, restarts: int, flag: str) -> tuple[int, str]:
    """engine.launch's exit status and reason for a failure it does not restart: a bad input
    keeps its 2; a failure after `restarts` (> 0, the launcher's `flag`) restarts is
    RESTARTS_SPENT_EXIT; without restarts, the task's own status."""
    if status == USER_ERROR_EXIT or restarts == 0:
        return status, cause
    return RESTARTS_SPENT_EXIT, f"{cause}; the {restarts} restart(s) of {flag} are spent"


def one_line(error: BaseException | str, limit: int | None = None) -> str:
    """`error`'s text on one line (TensorFlow's messages span several), cut to `limit` characters."""
    text = " ".join(str(error).split())
    return text if limit is None else text[:limit]


def printable(text: str) -> str:
    """`text` with every character that is not printable (escape sequences, newlines, carriage
    returns, bidirectional overrides) written as Python escapes (`\\x1b`, `\\n`, `\\u202e`): text
    read from a model_dir someone else made reaches the terminal as data, never as a colour,
    a moved cursor or a forged `engine.main: error:` line of its own."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


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
