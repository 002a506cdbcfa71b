"""engine/loop/iterator_release.py: an evaluation's iterator is freed off the loop's thread
(freeing a MultiDeviceIterator read to its end can block its thread for seconds)."""

import threading
import weakref

import tensorflow as tf
from helpers import make_arrays, make_trainer

from engine.loop import iterator_release, runners


def test_each_evaluations_iterator_is_freed_on_the_release_thread_and_counts_stay_exact(mirrored, monkeypatch):
    freed_on: list[str] = []
    distribute = runners.distribute_eval_data

    class Watched:
        """The distributed eval set, noting the thread each of its iterators is freed on."""

        def __init__(self, dataset):
            self._dataset = dataset

        def __iter__(self):
            iterator = iter(self._dataset)
            weakref.finalize(iterator, lambda: freed_on.append(threading.current_thread().name))
            return iterator

    monkeypatch.setattr(
        runners, "distribute_eval_data", lambda strategy, data: Watched(distribute(strategy, data))
    )
    x, y = make_arrays(37)  # a partial last batch, split unevenly over the two replicas
    trainer = make_trainer(mirrored, eval_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    for _ in range(2):
        assert trainer.evaluate()["num_examples"] == 37
    iterator_release.wait_until_all_freed()  # What the process's exit does: the thread ends after both.
    assert freed_on == ["engine-iterator-release"] * 2
    assert not any(thread.name == "engine-iterator-release" for thread in threading.enumerate())
