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
    handler.setFormatter(logging.Formatter("%(levelname).1s %(asctime)s engine] %(message)s", "%H:%M:%S"))
    handler.addFilter(_OwnLinesUnlessConfigured(engine_logger))
    engine_logger.addHandler(handler)
    return engine_logger


logger = _make_logger()
