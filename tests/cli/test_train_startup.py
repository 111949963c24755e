"""`qurl train` interrupted while it starts: one line on the console, no traceback."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # Ray's connection attempts return to Python only every few seconds
def test_ctrl_c_while_ray_starts_prints_one_line(tmp_path):
    """Ctrl-C while `ray.init` waits for a cluster nobody runs (before the run's own signal handling is up)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.Popen(
        [sys.executable, "-c", "import sys; from qurl_mcore.cli import main; sys.exit(main(sys.argv[1:]))", "train", "model.path=tiny-llama", "precision=bf16",
         "uaq.enabled=false", f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs", "--address",
         "127.0.0.1:1"], stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's background job ignores it
    try:
        seen = []
        while not any("steps of tiny-llama" in line for line in seen):  # the line just before ray.init
            seen.append(run.stderr.readline())
            assert seen[-1], "".join(seen)
        time.sleep(2)
        run.send_signal(signal.SIGINT)
        err = "".join(seen) + run.stderr.read()
        assert run.wait(timeout=180) == 128 + signal.SIGINT, err
    finally:
        run.kill()
    ours = [line for line in err.splitlines() if line.startswith("qurl train:")]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert ours[-1].startswith("qurl train: interrupted; ") and "starts it again" in ours[-1], err


def test_ray_failing_to_start_is_one_line(tmp_path, capsys, monkeypatch):
    """Ray refusing to start (here: an --address it cannot parse) ends `qurl train` with one line naming it."""
    from qurl_mcore.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["train", "model.path=tiny-llama", "precision=bf16", "uaq.enabled=false",
                 f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs", "--address", "nohost"])
    err = capsys.readouterr().err
    assert code == 1 and "qurl train: Ray did not start at nohost: Invalid address format: nohost\n" in err, err
    assert not list((tmp_path / "ckpt").glob(".qurl-run.lock"))  # the directories are free for the next run
