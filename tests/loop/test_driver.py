"""`qurl train`'s driver (loop/driver.py) around its actors: what a run holds is given back however it ends."""
from __future__ import annotations

import signal
import subprocess
from types import SimpleNamespace

import pytest
import ray

from qurl_mcore.config import load_config
from qurl_mcore.loop import driver
from qurl_mcore.runlock import lock_dirs


def test_a_loop_that_fails_to_start_gives_back_ray_the_signals_and_the_directories(tmp_path, monkeypatch, capsys):
    """...and stops, naming them, the processes the run started that outlive Ray."""
    cfg = load_config(None, ["model.path=tiny-llama", "precision=bf16", "uaq.enabled=false", "steps=1",
                             f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs"])
    calls, daemons = [], []
    ours = subprocess.Popen(["sleep", "60"])  # running before the run: not the run's to stop

    def init(**kwargs):  # Ray's daemons, one of which outlives ray.shutdown as its agents can
        calls.append("init")
        daemons.append(subprocess.Popen(["sleep", "60"]))

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(driver, "RAY_EXIT_GRACE_S", 0.5)

    class Unstartable:
        def __init__(self, cfg, stop):
            raise RuntimeError("no engine would start")

    monkeypatch.setattr(driver, "Loop", Unstartable)
    monkeypatch.setattr(driver, "preflight", lambda cfg, local: SimpleNamespace(ok=True))  # not what is tested
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError, match="no engine would start"):
            driver.run(cfg)
        assert daemons[0].wait(timeout=10) == -signal.SIGKILL and ours.poll() is None
    finally:
        ours.kill()
        ours.wait()
    assert calls == ["init", "shutdown"]
    assert (f"qurl train: stopped 1 process(es) the run started that outlived Ray: {daemons[0].pid} (sleep)"
            in capsys.readouterr().err)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    lock_dirs(cfg.checkpoint.dir, cfg.logging.dir).release()  # free for the next run
