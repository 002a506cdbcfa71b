"""What `engine.main` prints: the form of its log lines, which tasks of a cluster print
them, and the summary table at the end of a run.

- A line is its message: `step 10/20  loss=2.239 ...`; warnings and errors keep a
  marker (`warning: `, `error: `). `--log_prefix` brings back absl's prefix
  (`I1201 16:42:25.123456 140213 job.py:212] `) for tools that need the times.
- In a cluster only the chief speaks (worker 0 of multi_worker_mirrored, the
  coordinator of parameter_server) and an evaluator task (its evaluations are what
  it is for). The other tasks print warnings, errors and the lines marked
  `engine.logger.EVERY_TASK` (their start-up, their final `done:` line), each line
  prefixed by the task: `[worker:1] warning: ...`; `--log_all_tasks` lets them print
  everything.
- Every line is printed above the progress bar, never on it (`engine.status_line`).

The table at the end of a run is `engine.cli.run.summary`'s. This module imports no
TensorFlow: `engine.main` sets it up before TensorFlow's first import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from absl import logging as absl_logging

from engine.cli.config.settings.sections import ScheduleSettings
from engine.cluster import Cluster
from engine.logger import fit_to_terminal
from engine.status_line import status_line


@dataclasses.dataclass(frozen=True)
class Console:
    """How this process prints: absl's prefix or not, its task's prefix, and whether it speaks."""

    log_prefix: bool = False
    task_prefix: str = ""  # "[worker:1] " on a task that is not the chief; "" where it speaks for the run.
    speaks: bool = True  # False: warnings, errors and EVERY_TASK lines only, and no progress bar.

    @property
    def speaks_for_the_run(self) -> bool:
        """The task that prints the run's summary: the chief, an evaluator, a single process."""
        return self.speaks and not self.task_prefix

    @classmethod
    def for_run(cls, schedule: ScheduleSettings, cluster: Cluster | None) -> Console:
        """The console that --log_prefix and --log_all_tasks (`RunConfig.schedule`) ask for, as a
        task of `cluster`."""
        if cluster is None or cluster.is_chief or cluster.is_evaluator:
            return cls(log_prefix=schedule.log_prefix)
        prefix = f"[{cluster.task_type}:{cluster.task_index}] "
        return cls(log_prefix=schedule.log_prefix, task_prefix=prefix, speaks=schedule.log_all_tasks)


class MessageFormatter(logging.Formatter):
    """A record as its message; `warning: ` or `error: ` before the message of one at WARNING or above.
    On a terminal, a line longer than the terminal (less `prefix_width`, a task's prefix) is broken
    between its fields (`engine.logger.fit_to_terminal`), never mid-word by the terminal."""

    def __init__(self, prefix_width: int = 0):
        super().__init__()
        self._prefix_width = prefix_width

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            text = f"error: {text}"
        elif record.levelno >= logging.WARNING:
            text = f"warning: {text}"
        text = fit_to_terminal(text, self._prefix_width)
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        return text


class _TaskPrefixed(logging.Formatter):
    """Every line of `inner`'s text behind the task's name, so that a line read alone says whose it is."""

    def __init__(self, inner: logging.Formatter, prefix: str):
        super().__init__()
        self._inner, self._prefix = inner, prefix

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self._prefix + line for line in self._inner.format(record).split("\n"))


class _WarningsAndEveryTaskLines(logging.Filter):
    """What a task that does not speak for the run prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or bool(getattr(record, "every_task", False))


class TensorFlowPerSaveLines(logging.Filter):
    """TensorFlow's checkpoint writer logs "Sharding callback duration: N microseconds" at INFO,
    through absl, at every save: a line per checkpoint that tells the user nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO
            and record.pathname.endswith("functional_saver.py")
            and str(record.msg).startswith("Sharding callback duration")
        )


class _AboveTheBar(logging.Handler):
    """Stands in for a root handler while the console is set up: its lines are printed
    with the progress bar's line cleared first and the bar drawn again after."""

    def __init__(self, inner: logging.Handler):
        super().__init__(inner.level)
        self.inner = inner

    def handle(self, record: logging.LogRecord) -> bool:
        with status_line.suspended():
            return bool(self.inner.handle(record))

    def emit(self, record: logging.LogRecord) -> None:  # Not reached: handle() hands the record on.
        self.inner.emit(record)

    def format(self, record: logging.LogRecord) -> str:
        """The line as the handler it stands in for prints it (`logger.message_width` reads its prefix)."""
        return self.inner.format(record)

    def flush(self) -> None:
        self.inner.flush()


def _formatting_handler(handler: logging.Handler) -> logging.Handler:
    """The handler whose formatter prints: absl's handler hands records to its Python handler."""
    if isinstance(handler, absl_logging.ABSLHandler):
        return handler.python_handler
    return handler


@contextlib.contextmanager
def configured(console: Console) -> Iterator[None]:
    """Sets up every handler of the root logger (absl's in `engine.main`) as `console` says,
    and puts them back as they were afterwards (a test runs many commands in one process)."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    formatters = [_formatting_handler(handler).formatter for handler in handlers]
    quiet = _WarningsAndEveryTaskLines()
    muted = status_line.muted
    for handler, formatter in zip(handlers, formatters, strict=True):
        chosen: logging.Formatter = MessageFormatter(len(console.task_prefix))
        if console.log_prefix:
            chosen = formatter or logging.Formatter()
        if console.task_prefix:
            chosen = _TaskPrefixed(chosen, console.task_prefix)
        _formatting_handler(handler).setFormatter(chosen)
        if not console.speaks:
            handler.addFilter(quiet)
    root.handlers[:] = [_AboveTheBar(handler) for handler in handlers]
    status_line.muted = muted or not console.speaks
    try:
        yield
    finally:
        status_line.clear()
        status_line.muted = muted
        root.handlers[:] = [
            handler.inner if isinstance(handler, _AboveTheBar) else handler for handler in root.handlers
        ]
        for handler, formatter in zip(handlers, formatters, strict=True):
            _formatting_handler(handler).setFormatter(formatter)  # type: ignore[arg-type]
            handler.removeFilter(quiet)
