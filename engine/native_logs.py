"""TensorFlow's C++ start-up lines, kept out of `engine.main`'s output.

TensorFlow 2.21 logs from C++ through absl, and until `absl::InitializeLog()`
is called (nothing calls it) absl writes every line to stderr whatever
`TF_CPP_MIN_LOG_LEVEL` says (tensorflow/tensorflow#100442): the oneDNN and
CPU-feature notes and `cudart_stub` at import, `failed call to cuInit ...
(303)` when the devices are first listed on a host without a GPU. Later
lines (tf.data's warnings among them) do honour the variable, which
`engine.main` sets to 2 unless it is set already.

So the import and the first device listing run with file descriptor 2
pointed at a temporary file. Afterwards everything the file holds goes to
stderr except those C++ log lines; `TF_CPP_MIN_LOG_LEVEL=0` (all) or `1`
(warnings and errors) shows them too. Python's own output of that window
(a print, a warning, a traceback) is never dropped; a Python log line in
absl's format there can only be TensorFlow's own and is held back with them.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

# absl's format (I0000 00:00:1796043263.123665    8024 port.cc:153] ...) and TSL's older one.
_NATIVE_LINE = re.compile(
    r"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) \S+:\d+\])"
)
_BEFORE_INITIALIZE_LOG = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The second line of cpu_feature_guard's note.
_CONTINUATION = re.compile(r"^To enable the following instructions: .*compiler flags\.$")
_LEVELS = "IWEF"


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and lists its devices with the C++ start-up lines held back."""
    if "tensorflow" in sys.modules:
        return
    min_level = _min_level()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # Where cuInit runs and says there is no GPU.
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sys.stderr.write(kept_lines(captured.read().decode(errors="replace"), min_level))
            sys.stderr.flush()


def kept_lines(text: str, min_level: int) -> str:
    """`text` less the C++ log lines below `min_level` (0 I, 1 W, 2 E, 3 F; 2 and up hide them all:
    the start-up errors, cuInit's and "Unable to register cuDNN factory", are expected ones)."""
    kept, level = [], None
    for line in text.splitlines(keepends=True):
        native = _NATIVE_LINE.match(line)
        if native:
            level = _LEVELS.index(native.group(1) or native.group(2))
        elif line.rstrip("\n") == _BEFORE_INITIALIZE_LOG:
            level = 1
        elif not (level is not None and _CONTINUATION.match(line.rstrip("\n"))):
            level = None  # Python's output: always kept.
        if level is None or (min_level < 2 and level >= min_level):
            kept.append(line)
    return "".join(kept)


def _min_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0
