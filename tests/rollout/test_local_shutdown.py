"""`LocalEngine.shutdown` points SGLang's process-tree kill at the engine's own processes: engines shutting
down in two threads at once each kill their own, and SGLang's function is back afterwards."""
from __future__ import annotations

import os
import threading
import time

import pytest

from qurl_mcore.rollout.engine import LocalEngine

pytestmark = pytest.mark.slow  # importing SGLang's engine takes tens of seconds (in the test: not at collection)


class _SGLangEngine:
    """What LocalEngine.shutdown calls: SGLang's Engine.shutdown, which kills this process's descendants."""

    def __init__(self, sglang_engine):
        self.sglang_engine = sglang_engine

    def shutdown(self):
        time.sleep(0.2)  # the other thread's shutdown starts meanwhile
        self.sglang_engine.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)


def test_engines_shutting_down_together_each_kill_their_own(monkeypatch):
    sglang_engine = pytest.importorskip("sglang.srt.entrypoints.engine")
    killed = []
    monkeypatch.setattr(sglang_engine, "kill_process_tree",
                        lambda pid, include_parent=True, **kw: killed.append((pid, include_parent)))
    original = sglang_engine.kill_process_tree
    engines = []
    for pids in ([101, 102], [201]):
        engine = object.__new__(LocalEngine)  # the shutdown alone: no server
        engine.engine, engine._processes = _SGLangEngine(sglang_engine), pids
        engines.append(engine)
    threads = [threading.Thread(target=e.shutdown) for e in engines]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    assert sorted(killed) == [(101, True), (102, True), (201, True)]
    assert sglang_engine.kill_process_tree is original
