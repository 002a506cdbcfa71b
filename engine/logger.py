"""The engine's own log lines (progress, evaluations, checkpoints saved and restored).

They go to the Python logger "engine" at INFO, which is on by itself:
research code sees them on stderr without turning on absl's or
TensorFlow's INFO logs. Where logging is configured (an absl app such as
`engine.main`, or `logging.basicConfig`) they go through the root handlers
instead. `logging.getLogger("engine").setLevel(logging.WARNING)` silences them.
The engine's own handler prints above a progress bar, never on its line
(`engine.status_line`).
"""

from __future__ import annotations

import logging
import re
import sys

from engine.status_line import status_line

# `extra=` of a line that every task of a cluster prints, where a program shows only the chief's
# INFO lines (`engine.main`'s console): what one task alone can say (its start-up, its final weights).
EVERY_TASK = {"every_task": True}


class _OwnLinesUnlessConfigured(logging.Filter):
    """Decides once, at the engine's first log line, who prints them all: the root
    handlers where logging is configured by then (absl, `logging.basicConfig`), else the
    engine's own handler, which then keeps them from propagating. Deciding per line
    would switch formats mid-run when a library configures the root logger later."""

    def __init__(self, engine_logger: logging.Logger):
        super().__init__()
        self._logger = engine_logger
        self._own: bool | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self._own is None:
            self._own = not logging.getLogger().handlers
            if self._own:
                self._logger.propagate = False
        return self._own


class _FittedFormatter(logging.Formatter):
    """The engine's own format, each line of a message broken between its fields on a terminal."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        if _PROBE in text:  # `message_width` measuring the prefix.
            return text
        return fit_to_terminal(text, 0, indent=" " * text.find(record.message) + "  ")


class _AboveTheBar(logging.StreamHandler):
    """A stream handler whose lines never land on the progress bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        with status_line.suspended():
            super().emit(record)


def _make_logger() -> logging.Logger:
    engine_logger = logging.getLogger("engine")
    if engine_logger.level == logging.NOTSET:
        engine_logger.setLevel(logging.INFO)
    handler = _AboveTheBar()
    handler.setFormatter(_FittedFormatter("%(levelname).1s %(asctime)s engine] %(message)s", "%H:%M:%S"))
    handler.addFilter(_OwnLinesUnlessConfigured(engine_logger))
    engine_logger.addHandler(handler)
    return engine_logger


logger = _make_logger()

_PROBE = "\x00"  # A message no real line holds: where it lands in a formatted line is the prefix's width.


def _on_a_terminal() -> bool:
    """Whether the engine's lines go to a terminal (stderr, where every handler of theirs prints)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # A replaced or closed stream.
        return False


def fit_to_terminal(text: str, prefix_width: int, indent: str = "  ") -> str:
    """On a terminal, each line of `text` longer than its width less `prefix_width` broken between
    its fields (`wrap_line`); elsewhere `text` as it is."""
    if not _on_a_terminal():
        return text
    width = max(status_line.width() - prefix_width, 20)
    return "\n".join(wrap_line(line, width, indent) for line in text.split("\n"))


def message_width() -> int | None:
    """The characters a message of the engine's lines may take without wrapping on the terminal
    they are printed on: its width less what the printing handler puts before a message (absl's
    prefix, a task's, the engine's own `I 16:42:25 engine] `); None where they go to no terminal
    (a file, a pipe: there a line is whole, for the tools that read it)."""
    if not _on_a_terminal():
        return None
    handlers = logger.handlers if not logger.propagate else logging.getLogger().handlers or logger.handlers
    prefix = 0
    if handlers:
        probe = logging.LogRecord(logger.name, logging.INFO, __file__, 0, _PROBE, None, None)
        try:
            prefix = max(handlers[0].format(probe).find(_PROBE), 0)
        except Exception:  # noqa: BLE001  A handler that cannot format a bare record: no prefix known.
            prefix = 0
    return max(status_line.width() - prefix, 20)


def wrap_line(text: str, width: int | None, indent: str = "  ") -> str:
    """`text` on lines of at most `width` characters (None: as it is), broken only where its fields
    meet (two spaces, or a space after `,` or `;`, outside parentheses), each further line behind
    `indent`; a field longer than the width keeps a line of its own."""
    if width is None or len(text) <= width:
        return text
    pieces = re.split(r"((?<=[,;]) |  )", text)
    fields, separators = [pieces[0]], []
    for separator, piece in zip(pieces[1::2], pieces[2::2], strict=True):
        if fields[-1].count("(") > fields[-1].count(")"):  # Inside parentheses: `(28, 28, 1)` stays whole.
            fields[-1] += separator + piece
        else:
            fields.append(piece)
            separators.append(separator)
    lines, line = [], fields[0]
    for separator, field in zip(separators, fields[1:], strict=True):
        if len(line) + len(separator) + len(field) <= width:
            line += separator + field
        else:
            lines.append(line)
            line = indent + field
    return "\n".join([*lines, line])
