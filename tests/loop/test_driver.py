"""`qurl train`'s driver (loop/driver.py) around its actors: what a run holds is given back however it ends."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import ray

from qurl_mcore.config import load_config
from qurl_mcore.loop import driver
from qurl_mcore.runlock import lock_dirs


def test_a_loop_that_fails_to_start_gives_back_ray_the_signals_and_the_directories(tmp_path, monkeypatch):
    cfg = load_config(None, ["model.path=tiny-llama", "precision=bf16", "uaq.enabled=false", "steps=1",
                             f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs"])
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))

    class Unstartable:
        def __init__(self, cfg, stop):
            raise RuntimeError("no engine would start")

    monkeypatch.setattr(driver, "Loop", Unstartable)
    monkeypatch.setattr(driver, "preflight", lambda cfg, local: SimpleNamespace(ok=True))  # not what is tested
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="no engine would start"):
        driver.run(cfg)
    assert calls == ["init", "shutdown"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    lock_dirs(cfg.checkpoint.dir, cfg.logging.dir).release()  # free for the next run
