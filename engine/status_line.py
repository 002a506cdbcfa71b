"""The one line at the bottom of a terminal that the progress bar redraws in place.

A bar is drawn with a carriage return and no newline, so anything else
printed to the same terminal while it is shown would land on the bar's
line. Every log handler that may print there (the engine's own,
`engine.main`'s console) prints inside `status_line.suspended()`: the bar's
line is cleared, the log line printed, the bar drawn again below it.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from typing import TextIO

# Back to the line's start and erase it (ANSI "erase in line"; every terminal emulator in use).
_CLEAR = "\r\x1b[2K"


class StatusLine:
    """The bar's text and stream, and a lock that keeps a log line and a redraw from interleaving."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._text: str | None = None
        self._stream: TextIO | None = None
        self.muted = False  # Set by a program that shows no bar (a non-chief task of a cluster).

    def wanted(self, stream: TextIO) -> bool:
        """Whether a bar belongs on `stream`: a terminal, and not muted."""
        if self.muted:
            return False
        try:
            return stream.isatty()
        except (AttributeError, ValueError):  # A replaced or closed stream.
            return False

    @staticmethod
    def width() -> int:
        """The characters a line may hold on the terminal without wrapping (the last column left
        free: some terminals wrap on it)."""
        return max(shutil.get_terminal_size().columns - 1, 10)

    def show(self, text: str, stream: TextIO) -> None:
        """Draws `text` as the bar (over the previous one), cut to the terminal's width so it never wraps."""
        with self._lock:
            self._text, self._stream = text, stream
            self._write(_CLEAR + text[: self.width()])

    def clear(self) -> None:
        """Erases the bar; nothing is shown until the next `show`."""
        with self._lock:
            if self._text is not None:
                self._write(_CLEAR)
            self._text = None

    def finish(self) -> None:
        """Leaves the bar on the screen as it is, on a line of its own; the next `show` starts a new one."""
        with self._lock:
            if self._text is not None:
                self._write("\n")
            self._text = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Around printing a line elsewhere: the bar's line is cleared first and the bar drawn after."""
        with self._lock:
            text, stream = self._text, self._stream
            if text is None or stream is None:
                yield
                return
            self.clear()
            try:
                yield
            finally:
                self.show(text, stream)

    def _write(self, chars: str) -> None:
        stream = self._stream
        if stream is None:
            return
        with contextlib.suppress(OSError, ValueError):  # A closed terminal must not end the run.
            stream.write(chars)
            stream.flush()


status_line = StatusLine()  # One terminal per process.
