"""How engine.main's own process ends (`engine.cli.main_command.exit_process`)."""

import threading
import time

import pytest

from engine import compat
from engine.cli import main_command


class Exited(Exception):
    def __init__(self, status: int):
        self.status = status


def test_a_run_finishes_its_writes_and_handlers_then_exits_at_once(monkeypatch):
    """Without the interpreter's finalization (0.9 CPU-s a run; a parameter-server coordinator's
    could abort on TensorFlow's daemon threads): what it would have done (join the threads that
    are not daemons, run the exit handlers) happens first, in that order, with the run's status."""
    happened: list[str] = []

    def exit_now(status: int):
        happened.append(f"_exit({status})")
        raise Exited(status)

    def slow_write():
        time.sleep(0.3)
        happened.append("write done")

    monkeypatch.setattr(compat, "run_exit_handlers", lambda: happened.append("exit handlers"))
    monkeypatch.setattr(main_command.os, "_exit", exit_now)
    writer = threading.Thread(target=slow_write, name="checkpoint-7")  # as the background writer: no daemon
    writer.start()
    with pytest.raises(Exited):
        main_command.exit_process(3)
    assert happened == ["write done", "exit handlers", "_exit(3)"]
