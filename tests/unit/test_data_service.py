"""The tf.data service as the input of a run (`engine.DataService`, the data forms' `service=`):
with one data worker the batches and the trained weights are local input's, a resume is exact
and says how it starts; with several workers what each processing mode does to the stream is
measured; a dispatcher that is not there is one line within its bound. In-process dispatcher
and workers on loopback, ports from the OS.

Covers: engine/data_service.py.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import free_ports, global_batches, make_arrays, make_trainer, run_config, small_trainer
from tensorflow.python.data.experimental.ops import data_service_ops

import engine
from engine.data import through_service, with_service
from engine.data_service import DispatcherUnreachable, wait_for_dispatcher
from engine.errors import PEER_LOST_EXIT, UserError

service_lib = tf.data.experimental.service


@pytest.fixture(autouse=True)
def quick_task_refresh(monkeypatch):
    """A client asks the dispatcher for its tasks every 0.1 s, not TensorFlow's 1 s: it sees the end
    of each stream that much sooner (a second of waiting per pipeline read to its end, nothing
    the engine's input changes with). Through the private form of `distribute`, which takes it."""

    def distribute(*args, **kwargs):
        return data_service_ops._distribute(*args, task_refresh_interval_hint_ms=100, **kwargs)

    monkeypatch.setattr(service_lib, "distribute", distribute)


def _service(num_workers: int):
    dispatcher = service_lib.DispatchServer(service_lib.DispatcherConfig(port=0))
    address = dispatcher.target.removeprefix("grpc://")
    # Frequent heartbeats: a worker learns of a new job's task at its next one.
    config = service_lib.WorkerConfig(dispatcher_address=address, heartbeat_interval_ms=100)
    workers = [service_lib.WorkerServer(config) for _ in range(num_workers)]
    return dispatcher, workers


def _stop(dispatcher, workers) -> None:
    """The servers stop now, not when the collector frees them (a full collection: ~1 CPU-s)."""
    for worker in workers:
        worker._stop()
    dispatcher._stop()


@pytest.fixture(scope="module")
def one_worker():
    """A dispatcher and one data worker in this process: the service's address."""
    dispatcher, workers = _service(1)
    yield dispatcher.target
    _stop(dispatcher, workers)


@pytest.fixture(scope="module")
def two_workers():
    dispatcher, workers = _service(2)
    yield dispatcher.target
    _stop(dispatcher, workers)


def _ids(dataset: tf.data.Dataset) -> list[list[int]]:
    return [batch.numpy().tolist() for batch in dataset]


def test_the_option_refuses_bad_values_in_one_line():
    for address in ("nohost", "grpc://host:0", "host:port", "http://h:1/x"):
        with pytest.raises(UserError, match=r"DataService\(address=.*grpc://HOST:PORT"):
            engine.DataService(address=address)
    with pytest.raises(UserError, match="processing_mode='sharded'.*parallel_epochs, distributed_epoch"):
        engine.DataService(address="h:1", processing_mode="sharded")
    with pytest.raises(UserError, match="takes an engine.DataService"):
        engine.GlobalBatches(dataset=tf.data.Dataset.range(2), service="grpc://h:1")
    service = engine.DataService(address="h:5050")
    assert service.target == "grpc://h:5050"
    assert service.describe() == "tf.data service at grpc://h:5050 (parallel_epochs)"
    with pytest.raises(UserError, match="eval_data is read by the training process itself"):
        engine.data.as_eval_form(engine.GlobalBatches(dataset=tf.data.Dataset.range(2), service=service))


def test_the_flags_refuse_a_bad_address_and_parameter_servers():
    with pytest.raises(UserError, match=r"^--data_service=nohost must be a dispatcher's grpc://HOST:PORT"):
        run_config("--data_service=nohost")
    with pytest.raises(UserError, match="--strategy=parameter_server builds its input on each worker"):
        run_config("--data_service=grpc://h:1", "--strategy=parameter_server")
    config = run_config("--data_service=grpc://h:1", "--data_service_mode=distributed_epoch")
    assert config.cluster.data_service_option() == engine.DataService("grpc://h:1", "distributed_epoch")


def test_one_worker_serves_the_local_batches_in_order(one_worker):
    service = engine.DataService(address=one_worker)
    pipeline = tf.data.Dataset.range(60).shuffle(20, seed=4).batch(4).skip(3)  # A positioned pipeline.
    assert _ids(through_service(pipeline, service, position=3)) == _ids(pipeline)


@pytest.fixture(params=["default", pytest.param("mirrored", marks=pytest.mark.slow)])  # fast tier: default
def strategy(request):
    return request.getfixturevalue(request.param)


def _trained_weights(strategy, train_data, steps: int = 6) -> list[np.ndarray]:
    trainer = make_trainer(strategy, train_data=train_data, cadence=engine.Cadence(steps_per_loop=2))
    trainer.train(steps)
    weights = trainer.model.get_weights()
    trainer.close()
    return weights


def test_one_data_worker_trains_the_weights_of_local_input(strategy, one_worker, caplog):
    x, y = make_arrays(64)
    service = engine.DataService(address=one_worker)
    local = _trained_weights(strategy, global_batches(x, y, 16))
    with caplog.at_level(logging.INFO, logger="engine"):
        served = _trained_weights(strategy, with_service(global_batches(x, y, 16), service))
    for expected, got in zip(local, served, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert f"input: tf.data service at {one_worker} (parallel_epochs)" in caplog.text

    def per_replica(input_context, start_step):  # The other form: the pipeline positions itself.
        batch = input_context.get_per_replica_batch_size(16)
        return global_batches(x, y, batch).skip(engine.data.steps_to_elements(input_context, start_step))

    served = _trained_weights(strategy, engine.PerReplicaBatches(from_step=per_replica, service=service))
    for expected, got in zip(local, served, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_resume_with_one_data_worker_is_exact_and_says_where_it_starts(default, one_worker, tmp_path, caplog):
    x, y = make_arrays(64)
    service = engine.DataService(address=one_worker)
    first = small_trainer(tmp_path, train_data=with_service(global_batches(x, y, 16), service))
    first.train(4)
    first.close()
    with caplog.at_level(logging.WARNING, logger="engine"):
        resumed = small_trainer(tmp_path, train_data=with_service(global_batches(x, y, 16), service))
        resumed.train(8)
    weights = resumed.model.get_weights()
    resumed.close()
    assert resumed.step == 8
    assert (
        f"input from the tf.data service at {one_worker} (parallel_epochs) starts at the batches of step 4: "
        "every data worker skips the earlier ones itself; exact with one data worker, not with several"
        in caplog.text
    )
    uninterrupted = make_trainer(cadence=engine.Cadence(steps_per_loop=2))
    uninterrupted.train(8)
    for expected, got in zip(uninterrupted.model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(got, expected)
    uninterrupted.close()


@pytest.mark.slow  # Seconds of waiting on the service's task hand-out; the engine's own code is the fast tests'.
def test_what_several_workers_do_to_the_stream_measured(two_workers):
    """The figures docs/several-machines.md states: parallel_epochs runs the whole stream on every
    worker (each batch of a seeded pipeline comes once per worker); distributed_epoch hands each
    batch's source elements to one worker (each batch at most once per epoch), and a positioned
    pipeline's skip is each worker's own (which worker took how many is the order they asked in)."""
    pipeline = tf.data.Dataset.range(80).batch(4)  # 20 batches, told apart by their first id.
    parallel = _ids(pipeline.apply(service_lib.distribute("parallel_epochs", two_workers)))
    counts = collections.Counter(batch[0] for batch in parallel)
    assert sorted(counts) == list(range(0, 80, 4)) and set(counts.values()) == {2}, counts
    distributed = _ids(pipeline.apply(service_lib.distribute("distributed_epoch", two_workers)))
    elements = sorted(i for batch in distributed for i in batch)
    assert elements == list(range(80)), distributed  # Each element once; the batches are each worker's own.
    skipped = tf.data.Dataset.range(80).batch(4).skip(3)
    after = sorted(
        i
        for batch in _ids(skipped.apply(service_lib.distribute("distributed_epoch", two_workers)))
        for i in batch
    )
    assert len(after) == len(set(after)), after  # At most once.
    # Each worker skips 3 of its own batches: 3 to 2 x 3 batches of the epoch are never read.
    assert 3 * 4 <= 80 - len(after) <= 2 * 3 * 4, after


def test_a_dispatcher_that_is_not_there_is_one_line_within_its_bound():
    (port,) = free_ports(1)  # Free: nothing listens there.
    started = time.monotonic()
    with pytest.raises(DispatcherUnreachable) as raised:
        wait_for_dispatcher(f"grpc://localhost:{port}", timeout=0.5)
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "\n" not in message and raised.value.exit_status == PEER_LOST_EXIT
    assert message.startswith(
        f"cannot reach the tf.data service dispatcher at grpc://localhost:{port} within 0.5 s"
    )
    assert f"python -m engine.data_service --dispatcher --port={port}" in message


def test_pipelines_that_name_a_job_share_one_stream(one_worker):
    """Hosts that name the same job (at the same position) split its batches among them: none
    is read twice, and tf.distribute must not shard them again."""
    service = engine.DataService(address=one_worker, job_name="shared")
    pipeline = tf.data.Dataset.range(40).batch(4)
    first, second = (iter(through_service(pipeline, service, position=0)) for _ in range(2))
    read = [int(batch[0]) for iterator in (first, second) for batch in iterator]
    assert sorted(read) == list(range(0, 40, 4)), read  # Each batch once, whichever host took it.
    served = through_service(pipeline, service, position=0)
    assert served.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
