"""The one error type of input/: a data problem the user can fix from the
command line, shown as a single line instead of a TensorFlow traceback."""

from __future__ import annotations


class DataError(ValueError):
    """A data set is missing, unknown or unreadable; the message says what to do."""
