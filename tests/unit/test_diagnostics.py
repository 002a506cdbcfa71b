"""engine.diagnostics: the report a SIGUSR1 asks for (the signal itself, on a real
`engine.main`: tests/process/test_sigusr1_report.py).

Covers: engine/cluster/startup_watchdog.py.
"""

from __future__ import annotations

import os
import threading

import keras
import tensorflow as tf
from helpers import make_trainer

from engine import diagnostics
from engine.options import Cadence


def test_a_report_names_the_progress_every_thread_and_where_each_one_waits():
    release = threading.Event()

    def wait_for_the_release_of_a_named_thread():
        release.wait(timeout=30)

    waiting = threading.Thread(target=wait_for_the_release_of_a_named_thread, name="input-reader")
    waiting.start()
    try:
        progress = {"last completed step": 1340, "doing": "eval for 2.0 s"}
        text = diagnostics.report(progress, task="main")
    finally:
        release.set()
        waiting.join()
    header, stacks = text.split("\n\n", 1)
    assert header.startswith("engine diagnostics of main, pid ")
    assert "\nlast completed step: 1340\ndoing: eval for 2.0 s\n" in header + "\n"
    assert f"input-reader ({waiting.ident:#x})" in header and "MainThread" in header
    # faulthandler's stacks, most recent call first: the waiting thread sits in its function.
    assert f"Thread {waiting.ident:#018x}" in stacks
    assert "in wait_for_the_release_of_a_named_thread" in stacks
    assert "in test_a_report_names_the_progress_every_thread_and_where_each_one_waits" in stacks


def test_a_report_is_cut_at_its_bound(monkeypatch):
    monkeypatch.setattr(diagnostics, "MAX_BYTES", 600)
    text = diagnostics.report({"doing": "x" * 2000}, task="main")
    assert len(text.encode()) <= 600 and text.endswith("... cut at 600 bytes\n")


def test_a_second_report_replaces_the_first_and_leaves_no_temporary_file(tmp_path):
    directory = str(tmp_path / "run" / "diagnostics")
    first = diagnostics.write_report(directory, diagnostics.task_name("worker", 1), "first\n")
    second = diagnostics.write_report(directory, diagnostics.task_name("worker", 1), "second\n")
    assert first == second == f"{directory}/worker-1.txt"
    assert (tmp_path / "run" / "diagnostics" / "worker-1.txt").read_text() == "second\n"
    assert [p.name for p in (tmp_path / "run" / "diagnostics").iterdir()] == ["worker-1.txt"]
    assert diagnostics.task_name(None, None) == "main"


def test_reports_are_never_written_through_planted_temporary_links(tmp_path):
    """The old temporaries had predictable names (`<task>.txt.tmp<pid>`, the start-up watchdog's
    `<task>.txt.partial-<pid>`), opened following links: a model_dir from someone else holding
    them as links to a user's file had that file replaced by the report."""
    import subprocess
    import sys

    from engine.cluster import startup_watchdog

    victim = tmp_path / "victim"
    victim.write_text("the user's own file\n")
    directory = tmp_path / "run" / "diagnostics"
    directory.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # A pid nothing answers to: the watchdog's signal to it is a no-op.
    for pid in {*range(1, 2049), *range(os.getpid() - 16, os.getpid() + 2049), dead.pid}:
        (directory / f"main.txt.tmp{pid}").symlink_to(victim)
        (directory / f"worker-0.txt.partial-{pid}").symlink_to(victim)
    diagnostics.write_report(str(directory), "main", "report\n")
    stacks = tmp_path / "stacks"
    stacks.write_text("Thread 0x1 (most recent call first):\n")
    report = directory / "worker-0.txt"
    assert startup_watchdog.write_report(dead.pid, "worker:0", str(report), str(stacks), ended="timed out")
    assert victim.read_text() == "the user's own file\n"
    assert (directory / "main.txt").read_text() == "report\n" and "Thread 0x1" in report.read_text()
    assert not [p.name for p in directory.iterdir() if not p.is_symlink() and p.suffix != ".txt"]


def test_a_diagnostics_folder_that_is_a_symbolic_link_is_refused_and_nothing_is_written_through_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "diagnostics").symlink_to(elsewhere)  # A model_dir from someone else.
    try:
        diagnostics.write_report(str(tmp_path / "run" / "diagnostics"), "main", "report\n")
    except OSError as error:
        assert "is a symbolic link" in str(error)
    else:
        raise AssertionError("a report was written through a symbolic link")
    assert list(elsewhere.iterdir()) == []


def test_the_trainers_progress_says_the_last_step_and_the_loop_under_way_without_reading_a_variable():
    """Asked from inside a compiled call (a py_function in the loss, as the watcher thread would
    ask while the main thread sits there): the loop it is in, and the step it started from."""
    seen: list[dict] = []
    trainer = None

    def loss_that_asks(y, logits):
        def ask():
            seen.append(trainer.progress())
            return 0.0

        asked = tf.py_function(ask, [], tf.float32)
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits) + 0.0 * asked

    trainer = make_trainer(loss_fn=loss_that_asks, cadence=Cadence(steps_per_loop=3))
    before = {"last completed step": None, "doing": "between phases", "stop requested": False}
    assert trainer.progress() == before
    trainer.train(6)
    # Three steps a loop: the first loop's calls start from step 0, the second's from step 3.
    starts = [entry["doing"].split("(a loop from step ")[1] for entry in seen]
    assert starts == ["0, training to step 6)"] * 3 + ["3, training to step 6)"] * 3, seen
    assert all(entry["doing"].startswith("train for ") for entry in seen)
    assert trainer.progress()["last completed step"] == 6
    assert trainer.progress()["doing"] == "between phases"
