"""A process whose input iterator's destructor never returns (TensorFlow's tf.data, now and
then) still ends: a library user's after `iterator_release.EXIT_WAIT_S`, with one warning line;
engine.main's at once, since it ends without the interpreter's finalization; a research script
whose Trainer still holds its training iterator at once too, since that one is never freed."""

import subprocess
import sys
import time

import pytest
from helpers import REPO, python_env

# An object whose destructor never returns, as tf.data's iterator's now and then.
HELD_IN_ITS_DESTRUCTOR = """
import threading


class HeldInItsDestructor:
    def __del__(self, _wait=threading.Event().wait):  # Bound here: the finalization clears globals.
        _wait(600)
"""
HELD = (
    HELD_IN_ITS_DESTRUCTOR
    + """
from engine.loop import iterator_release

iterator_release.release_in_background([HeldInItsDestructor()])
"""
)


def run(program: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120
    )
    return done, time.monotonic() - began


@pytest.mark.process
def test_a_library_users_process_ends_after_the_bounded_wait_naming_what_it_left():
    done, took = run(HELD + "iterator_release.EXIT_WAIT_S = 2.0\nprint('trained')\n")
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr[-3000:]
    assert "1 input iterator(s) still being freed after 2 s" in done.stderr
    assert took < 60, took


@pytest.mark.process
def test_engine_mains_exit_does_not_wait_for_a_destructor():
    done, took = run(HELD + "from engine.cli.main_command import exit_process\nexit_process(0)\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "still being freed" not in done.stderr
    assert took < 40, took  # The library's wait would be EXIT_WAIT_S = 60 s.


# A research script's Trainer, never closed, whose training iterator's destructor never returns
# (as tf.data's waits for its autotuning thread, up to a minute, now and then forever).
NEVER_CLOSED = (
    HELD_IN_ITS_DESTRUCTOR
    + """
import sys

sys.path.insert(0, {tests!r})
from helpers import make_trainer

from engine.loop import runners

distribute = runners.distribute_train_data


class SlowToFree:
    def __init__(self, dataset):
        self._dataset = dataset

    def __iter__(self):
        iterator = iter(self._dataset)
        iterator.held = HeldInItsDestructor()  # Its destructor runs when the iterator is freed.
        return iterator


runners.distribute_train_data = lambda strategy, data, start_step: SlowToFree(
    distribute(strategy, data, start_step=start_step)
)
trainer = make_trainer()
print("trained", trainer.train(2)["loss"] > 0)
"""
)


@pytest.mark.process
def test_a_research_scripts_unclosed_trainer_ends_with_the_script_leaving_its_iterator_unfreed():
    """Its finalization would free the iterator on its one thread; the exit leaves it instead."""
    done, took = run(NEVER_CLOSED.format(tests=str(REPO / "tests")))
    assert done.returncode == 0 and done.stdout == "trained True\n", done.stderr[-3000:]
    assert "still being freed" not in done.stderr
    assert took < 60, took  # Freed at finalization, the process would wait 600 s (the run's timeout: 120 s).
