"""What an engine command sets at its first line (engine/command_start.py)."""

import gc
import os

import pytest

from engine import command_start


@pytest.fixture
def restored_threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


@pytest.fixture(autouse=True)
def exit_handlers(monkeypatch):
    """What `tune_for_start_up` registers to run at exit, kept from this test process's own."""
    registered: list = []
    monkeypatch.setattr(command_start.atexit, "register", registered.append)
    return registered


@pytest.mark.parametrize("set_by_user", [None, "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_numpy_blas_gets_one_thread_unless_the_environment_says(set_by_user, monkeypatch, restored_threshold):
    for name in command_start.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if set_by_user:
        monkeypatch.setenv(set_by_user, "4")
    command_start.tune_for_start_up()
    expected = {set_by_user: "4"} if set_by_user else {"OPENBLAS_NUM_THREADS": "1"}
    present = {name: os.environ[name] for name in command_start.BLAS_THREAD_VARIABLES if name in os.environ}
    assert present == expected


def test_the_first_generation_is_collected_less_often_and_the_older_ones_as_before(restored_threshold):
    gc.set_threshold(700, 10, 10)
    command_start.tune_for_start_up()
    assert gc.get_threshold() == (command_start.FIRST_GENERATION_THRESHOLD, 10, 10)


def test_the_last_exit_handler_freezes_the_collector_so_finalization_skips_the_run_s_objects(
    exit_handlers, restored_threshold
):
    command_start.tune_for_start_up()
    assert exit_handlers == [command_start.skip_the_final_collection]
    alive = [object()]  # A container: the collector tracks it.
    try:
        exit_handlers[0]()
        assert gc.get_freeze_count() > 0
        assert not any(tracked is alive for generation in range(3) for tracked in gc.get_objects(generation))
    finally:
        gc.unfreeze()
