"""Graceful stop on SIGTERM/SIGINT: finish the loop, save, exit 128+signal.

Schedulers preempt with SIGTERM and people with Ctrl-C. Either way the
trainer is asked to stop after the compiled loop it is running (at most
`steps_per_loop` steps), saves a checkpoint and writes its summaries; a
restart with the same flags continues from there. A second signal is not
caught, so it ends the process at once.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

from absl import logging

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalRecord:
    """Which signal arrived, if any."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def exit_status(self) -> int:
        return 128 + self.signum if self.signum is not None else 0


@contextlib.contextmanager
def stop_on_signals(trainer) -> Iterator[SignalRecord]:
    record = SignalRecord()
    previous = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}

    def handle(signum, frame):
        record.signum = signum
        for handled in HANDLED_SIGNALS:  # A second signal ends the process.
            signal.signal(handled, signal.SIG_DFL)
        logging.warning("%s received: stopping after this loop and saving a checkpoint",
                        signal.Signals(signum).name)
        trainer.request_stop()

    for signum in HANDLED_SIGNALS:
        signal.signal(signum, handle)
    try:
        yield record
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
