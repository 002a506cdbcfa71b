"""A parameter server that stops answering ends the chief within --heartbeat_timeout, in one
line naming it (engine.cluster.ps_watch). Here the ps tasks are stand-ins in this process: a gRPC
server answering TensorFlow's GetStatus as a live task does, and a socket that accepts and never
answers, as a frozen process's kernel does; the real frozen ps: tests/cluster/test_multi_worker.py."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc

from engine.cluster.ps_watch import PsWatch, answers


def live_task() -> tuple[grpc.Server, str]:
    """A server that answers GetStatus, as a TensorFlow task's own gRPC server does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: b"", request_deserializer=bytes, response_serializer=bytes
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tensorflow.WorkerService", {"GetStatus": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def frozen_task() -> tuple[socket.socket, str]:
    """A port whose connections are accepted (by the kernel) and never answered: SIGSTOP's."""
    listener = socket.create_server(("127.0.0.1", 0))
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_frozen_task_does_not_answer_and_a_live_one_does():
    server, live = live_task()
    listener, frozen = frozen_task()
    try:
        began = time.monotonic()
        assert answers(live, 2.0)
        assert not answers(frozen, 0.5)
        assert time.monotonic() - began < 2.0
    finally:
        server.stop(0)
        listener.close()


def test_the_watch_ends_the_run_naming_the_silent_ps_task_within_its_bound():
    server, live = live_task()
    listener, frozen = frozen_task()
    ended: list[tuple[float, str]] = []
    ps = [("ps:0", live), ("ps:1", frozen)]
    began = time.monotonic()
    try:
        with PsWatch(
            "chief:0",
            ps,
            timeout=1.0,
            kept=lambda: "the latest checkpoint (ckpt-20) is kept",
            end=lambda line: ended.append((time.monotonic() - began, line)),
        ):
            while not ended and time.monotonic() - began < 10:
                time.sleep(0.05)
    finally:
        server.stop(0)
        listener.close()
    assert len(ended) == 1, ended
    took, line = ended[0]
    assert line == (
        f"chief:0: ps:1 ({frozen}) stopped answering (no answer for 1 s): frozen, partitioned or dead; "
        "the latest checkpoint (ckpt-20) is kept; rerun, or use engine.launch --max_restarts"
    )
    assert 1.0 < took < 1.0 + 3.0, took  # The bound, plus a period and its probes (0.5 s), and a busy machine.


def test_live_ps_tasks_are_watched_without_an_end_and_the_watch_stops_with_its_block():
    server, live = live_task()
    ended: list[str] = []
    try:
        with PsWatch("chief:0", [("ps:0", live)], timeout=0.5, kept=lambda: "", end=ended.append) as watch:
            time.sleep(1.5)  # three bounds
        assert not watch._thread.is_alive()
    finally:
        server.stop(0)
    assert ended == []
