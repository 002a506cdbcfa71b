"""The one exception type for mistakes a user can fix (flags, data, model_dir).

`engine.main` prints these as a single line and exits non-zero; anything else
is a bug in the engine and keeps its traceback.
"""


class UserError(Exception):
    """A bad input: the message says what is wrong and what to do."""
