"""The in-process engine's lifetime inside a process that has other children."""
from __future__ import annotations

import multiprocessing

import psutil
import pytest

from .conftest import local_engine, model_path

pytestmark = pytest.mark.slow  # a real engine


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_shutdown_stops_the_engines_processes_and_no_other_child_of_the_process():
    # what Megatron's checkpoint writer keeps for the life of a process: a forked multiprocessing Manager
    manager = multiprocessing.get_context("fork").Manager()
    try:
        queue = manager.Queue()
        before = {p.pid for p in psutil.Process().children()}
        with local_engine(model_path("llama"), None):
            started = [p.pid for p in psutil.Process().children() if p.pid not in before]
            assert started and all(map(_running, started))
        assert not any(map(_running, started)), "the engine's scheduler or detokenizer outlived its shutdown"
        queue.put("after")  # a broken pipe or refused connection had the engine killed the Manager
        assert queue.get(timeout=10) == "after"
    finally:
        manager.shutdown()
