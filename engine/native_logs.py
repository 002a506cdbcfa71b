"""TensorFlow's C++ start-up lines, kept out of `engine.main`'s output.

TensorFlow 2.21 logs from C++ through absl, and until `absl::InitializeLog()`
is called (nothing calls it) absl writes every line to stderr whatever
`TF_CPP_MIN_LOG_LEVEL` says (tensorflow/tensorflow#100442): the oneDNN and
CPU-feature notes and `cudart_stub` at import, `failed call to cuInit ...
(303)` when the devices are first listed on a host without a GPU. Later
lines (tf.data's warnings among them) do honour the variable, which
`engine.main` sets to 2 unless it is set already.

So the import and the first device listing run with file descriptor 2
pointed at a pipe. A process forked for the purpose reads it and passes
everything on to stderr as it comes, except those C++ log lines;
`TF_CPP_MIN_LOG_LEVEL=0` (all) or `1` (warnings and errors) shows them too.
Python's own output of that window (a print, a warning, a traceback) is
never dropped, not even when the process dies in the middle of the import
(an abort, a signal, `os._exit`): the reader outlives it and empties the
pipe (a temporary file read afterwards lost all of it, which left tasks
that died there without a word). A Python log line in absl's format there
can only be TensorFlow's own and is held back with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator

# absl's format (I0000 00:00:1796043263.123665    8024 port.cc:153] ...) and TSL's older one.
# A C++ source's line; absl's Python logging writes the same form naming a .py file, which is
# the engine's own (a start-up signal's last word among them) and is kept.
_NATIVE_LINE = re.compile(
    r"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+(?<!\.py):\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) \S+:\d+\])"
)
_BEFORE_INITIALIZE_LOG = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The second line of cpu_feature_guard's note.
_CONTINUATION = re.compile(r"^To enable the following instructions: .*compiler flags\.$")
_LEVELS = "IWEF"
_FATAL = _LEVELS.index("F")
_READER_EXIT_SECONDS = 10.0


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and lists its devices with the C++ start-up lines held back."""
    if "tensorflow" in sys.modules:
        return
    with stderr_filtered(_min_level()):
        import tensorflow as tf

        tf.config.list_physical_devices()  # Where cuInit runs and says there is no GPU.


@contextlib.contextmanager
def stderr_filtered(min_level: int) -> Iterator[None]:
    """Within the block, what is written to file descriptor 2 reaches stderr line by line
    through a forked reader that drops the C++ log lines below `min_level` (`kept_lines`)."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    reader = os.fork()
    if reader == 0:  # The reader: its stderr is still the real one.
        try:
            os.close(write_end)
            _ignore_stop_signals()  # It ends when the pipe does: at the block's end or the process's death.
            _pass_on(read_end, 2, min_level)
        finally:
            os._exit(0)
    os.close(read_end)
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # Closes the pipe's last write end: the reader empties it and exits.
        os.close(saved)
        _reap(reader, _READER_EXIT_SECONDS)


def kept_lines(text: str, min_level: int) -> str:
    """`text` less the C++ log lines below `min_level` (0 I, 1 W, 2 E, 3 F; 2 and up hide all but
    the fatal ones: the start-up errors, cuInit's and "Unable to register cuDNN factory", are
    expected ones, while a fatal line is the last word of a process about to abort)."""
    lines = _LineFilter(min_level)
    return "".join(line for line in text.splitlines(keepends=True) if lines.keep(line))


class _LineFilter:
    """Decides line by line; a continuation line goes with the C++ line before it."""

    def __init__(self, min_level: int):
        self.min_level = min_level
        self._level: int | None = None  # The level of the C++ line being continued, if any.

    def keep(self, line: str) -> bool:
        native = _NATIVE_LINE.match(line)
        if native:
            self._level = _LEVELS.index(native.group(1) or native.group(2))
        elif line.rstrip("\n") == _BEFORE_INITIALIZE_LOG:
            self._level = 1
        elif not (self._level is not None and _CONTINUATION.match(line.rstrip("\n"))):
            self._level = None  # Python's output: always kept.
        return (
            self._level is None
            or self._level == _FATAL
            or (self.min_level < 2 and self._level >= self.min_level)
        )


def _pass_on(source: int, target: int, min_level: int) -> None:
    """Copies `source` to `target` until end of file, line by line, less the dropped lines. A
    `target` that cannot take more (a closed terminal) is skipped: the pipe is emptied anyway."""
    lines = _LineFilter(min_level)
    pending = b""
    while chunk := os.read(source, 65536):
        *complete, pending = (pending + chunk).split(b"\n")
        text = (f"{line}\n" for line in (part.decode(errors="replace") for part in complete))
        _write_all(target, "".join(line for line in text if lines.keep(line)).encode())
    last = pending.decode(errors="replace")  # A last line without its newline.
    if last and lines.keep(last):
        _write_all(target, last.encode())


def _write_all(target: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(target, data) :]


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # Not the main thread: they stay as they were.
            signal.signal(signum, signal.SIG_IGN)


def _reap(pid: int, seconds: float) -> None:
    """Waits for the reader to empty the pipe, so that later lines come after the window's; a
    process started in the window that holds the pipe open lets it outlive the wait."""
    deadline = time.monotonic() + seconds
    with contextlib.suppress(ChildProcessError):  # SIGCHLD ignored: reaped already.
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.005)


def _min_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0
