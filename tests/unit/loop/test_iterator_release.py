"""engine/loop/iterator_release.py: an evaluation's iterator, and a prediction's, is freed off
the loop's thread (freeing a MultiDeviceIterator read to its end can block its thread for seconds,
now and then forever): each on a thread of its own, the exit's wait bounded."""

import gc
import logging
import re
import threading
import time
import weakref

import numpy as np
import pytest
import tensorflow as tf
from helpers import make_arrays, make_trainer

from engine.loop import iterator_release, runners
from engine.options import Cadence


def freed(freed_on: list[str], count: int, timeout_s: float = 30.0) -> list[str]:
    """`freed_on` once `count` iterators were let go (their Python objects; TensorFlow's destructor
    runs after that on the same thread, and may take long)."""
    deadline = time.monotonic() + timeout_s
    while len(freed_on) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return freed_on


class Watched:
    """A distributed data set, noting in `freed_on` the thread each of its iterators is freed on."""

    def __init__(self, dataset, freed_on: list[str]):
        self._dataset = dataset
        self._freed_on = freed_on

    def __iter__(self):
        iterator = iter(self._dataset)
        weakref.finalize(iterator, lambda: self._freed_on.append(threading.current_thread().name))
        return iterator


def test_each_evaluations_iterator_is_freed_on_the_release_thread_and_counts_stay_exact(mirrored, monkeypatch):
    freed_on: list[str] = []
    distribute = runners.distribute_eval_data
    monkeypatch.setattr(
        runners, "distribute_eval_data", lambda strategy, data: Watched(distribute(strategy, data), freed_on)
    )
    x, y = make_arrays(37)  # a partial last batch, split unevenly over the two replicas
    trainer = make_trainer(mirrored, eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    for _ in range(2):
        assert trainer.evaluate()["num_examples"] == 37
    assert freed(freed_on, 2) == ["engine-iterator-release"] * 2


def test_each_predictions_iterator_is_freed_on_the_release_thread_and_every_row_is_back(mirrored, monkeypatch):
    freed_on: list[str] = []
    distribute = mirrored.experimental_distribute_dataset
    monkeypatch.setattr(
        mirrored, "experimental_distribute_dataset", lambda dataset: Watched(distribute(dataset), freed_on)
    )
    x, _ = make_arrays(37)
    trainer = make_trainer(mirrored)
    expected = trainer.model(x).numpy()
    for _ in range(2):
        np.testing.assert_allclose(trainer.predict(x), expected, rtol=1e-6, atol=1e-6)
    assert freed(freed_on, 2) == ["engine-iterator-release"] * 2


@pytest.fixture
def training_iterators_freed_on(monkeypatch) -> list[str]:
    """The threads the training iterators are freed on, in order."""
    freed_on: list[str] = []
    distribute = runners.distribute_train_data
    monkeypatch.setattr(
        runners,
        "distribute_train_data",
        lambda strategy, data, start_step: Watched(distribute(strategy, data, start_step=start_step), freed_on),
    )
    return freed_on


def test_a_replaced_or_closed_training_iterator_is_freed_on_the_release_thread(
    default, training_iterators_freed_on
):
    freed_on = training_iterators_freed_on
    trainer = make_trainer(default, cadence=Cadence(steps_per_loop=2))
    trainer.train(2)
    trainer.train_runner.run(0, 2)  # From another stream position: a new iterator, the old one let go.
    trainer.close()  # The current one let go too.
    assert freed(freed_on, 2) == ["engine-iterator-release"] * 2
    assert trainer.train(6)["loss"] > 0  # After close(), training makes a new iterator.


def test_a_trainer_dropped_without_close_frees_its_training_iterator_off_the_loops_thread(
    mirrored, training_iterators_freed_on
):
    """A research loop that makes a Trainer per trial and drops it: the Trainer's iterator must not
    be freed on the loop's thread either (the suite's in-process tests stalled there, 5-12 s)."""
    freed_on = training_iterators_freed_on
    for _ in range(2):
        trainer = make_trainer(mirrored, cadence=Cadence(steps_per_loop=2))
        assert trainer.train(2)["loss"] > 0
        dropped = weakref.ref(trainer)
        del trainer
        assert dropped() is None  # No cycle keeps a Trainer: it goes where its last name goes.
    assert freed(freed_on, 2) == ["engine-iterator-release"] * 2


def test_the_iterator_of_a_call_that_raised_is_freed_on_the_release_thread_and_the_next_call_makes_another(
    default, training_iterators_freed_on, monkeypatch
):
    """Where a raising call left the stream is unknown; its traceback's frames hold the iterator
    after the Trainer lets go of it, and the release thread frees it once they let go too."""
    freed_on = training_iterators_freed_on
    monkeypatch.setattr(iterator_release, "_HANDOVER_WAIT_S", 0.05)  # Nothing gives up on it after this.
    trainer = make_trainer(default, cadence=Cadence(steps_per_loop=2))
    real = runners.TrainRunner._call

    def fails_once(self, iterator, *args):
        monkeypatch.setattr(runners.TrainRunner, "_call", real)
        raise tf.errors.UnavailableError(None, None, "the source went away")

    monkeypatch.setattr(runners.TrainRunner, "_call", fails_once)
    with pytest.raises(tf.errors.UnavailableError) as raised:
        trainer.train(2)
    time.sleep(0.2)
    assert freed_on == []  # The traceback still holds it.
    del raised
    assert freed(freed_on, 1) == ["engine-iterator-release"]
    assert trainer.train(2)["loss"] > 0 and trainer.step == 2  # From a new iterator at step 0.
    trainer.close()
    assert freed(freed_on, 2) == ["engine-iterator-release"] * 2


class AnIterator:
    """Any object the loop lets go of."""


def test_an_iterator_a_reference_cycle_still_holds_is_freed_on_the_release_thread_not_by_the_collector(
    monkeypatch,
):
    """MirroredStrategy keeps a raising call's exception in a cycle with its traceback, whose
    frames hold the iterator: only the collector frees that cycle, on whichever thread it runs
    (a replica thread tracing: a 24 s stall in the suite). The release thread holds on until it
    holds the only reference, however long the cycle lives."""
    monkeypatch.setattr(iterator_release, "_HANDOVER_WAIT_S", 0.05)
    freed_on: list[str] = []
    iterator = AnIterator()
    weakref.finalize(iterator, lambda: freed_on.append(threading.current_thread().name))
    cycle: dict = {"iterator": iterator}
    cycle["itself"] = cycle
    iterator_release.release_in_background([iterator])
    del iterator, cycle
    time.sleep(0.2)
    assert freed_on == []
    # On this thread: it frees the cycle, and the release thread the iterator. The young
    # generations hold it (a full collection costs a suite worker ~1 CPU-s), unless a collection
    # meanwhile moved it to the oldest.
    gc.collect(1)
    if not freed(freed_on, 1, timeout_s=2.0):
        gc.collect()
    assert freed(freed_on, 1) == ["engine-iterator-release"]


class HeldInItsDestructor:
    """An iterator whose destructor does not return until `let_go` is set (TensorFlow's, now and
    then: never); `returned` is set when it does."""

    def __init__(self, let_go: threading.Event, returned: threading.Event):
        self._let_go, self._returned = let_go, returned

    def __del__(self):
        self._let_go.wait(60)
        self._returned.set()


def test_a_destructor_that_never_returns_holds_no_other_iterator_and_the_exits_wait_is_bounded(caplog):
    """The worker's earlier tests may still be freeing real iterators (fresh-ci once counted 2
    held here): the line counts this test's held one among them."""
    let_go, returned = threading.Event(), threading.Event()
    freed_on: list[str] = []
    stuck, after = HeldInItsDestructor(let_go, returned), AnIterator()
    weakref.finalize(after, lambda: freed_on.append(threading.current_thread().name))
    iterator_release.release_in_background([stuck])
    iterator_release.release_in_background([after])
    del stuck, after
    try:
        assert freed(freed_on, 1) == ["engine-iterator-release"]  # Not queued behind the held one.
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="engine"):
            assert iterator_release.wait_until_all_freed(timeout_s=0.5) is False
        assert time.monotonic() - began < 5
        held = re.search(r"(\d+) input iterator\(s\) still being freed after 0\.5 s", caplog.text)
        assert held and int(held.group(1)) >= 1, caplog.text
    finally:
        let_go.set()
    assert returned.wait(30)  # Freed once its destructor returns.
