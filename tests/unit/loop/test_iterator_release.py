"""engine/loop/iterator_release.py: an evaluation's iterator, and a prediction's, is freed off
the loop's thread (freeing a MultiDeviceIterator read to its end can block its thread for seconds)."""

import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf
from helpers import make_arrays, make_trainer

from engine.loop import iterator_release, runners


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
    iterator_release.wait_until_all_freed()  # What the process's exit does: the thread ends after both.
    assert freed_on == ["engine-iterator-release"] * 2
    assert not any(thread.name == "engine-iterator-release" for thread in threading.enumerate())


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
    iterator_release.wait_until_all_freed()
    assert freed_on == ["engine-iterator-release"] * 2


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
    trainer = make_trainer(default, steps_per_loop=2)
    trainer.train(2)
    trainer.train_runner.run(0, 2)  # From another stream position: a new iterator, the old one let go.
    trainer.close()  # The current one let go too.
    iterator_release.wait_until_all_freed()
    assert freed_on == ["engine-iterator-release"] * 2
    assert trainer.train(6)["loss"] > 0  # After close(), training makes a new iterator.


def test_a_trainer_dropped_without_close_frees_its_training_iterator_off_the_loops_thread(
    mirrored, training_iterators_freed_on
):
    """A research loop that makes a Trainer per trial and drops it: the Trainer's iterator must not
    be freed on the loop's thread either (the suite's in-process tests stalled there, 5-12 s)."""
    freed_on = training_iterators_freed_on
    for _ in range(2):
        trainer = make_trainer(mirrored, steps_per_loop=2)
        assert trainer.train(2)["loss"] > 0
        dropped = weakref.ref(trainer)
        del trainer
        assert dropped() is None  # No cycle keeps a Trainer: it goes where its last name goes.
    iterator_release.wait_until_all_freed()
    assert freed_on == ["engine-iterator-release"] * 2
