"""A run's processes killed under it: an engine is replaced, a trainer ends the run naming it. (Across nodes:
test_faults_multinode.py.)"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from qurl_mcore.checkpoint import latest_checkpoint, read_meta
from tests.loop.runs import metrics, start, wait_for_step


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_a_killed_trainer_ends_the_run_naming_it(tmp_path):
    """With rollout.offload (engines release their memory while the trainer steps, as on GPUs): the engine
    killed after step 1 is restarted, the push resumes only the memory the others released, and the run goes on.
    Then the trainer, killed after step 3's checkpoint, ends the run with one message that names it (and does not
    blame an engine), keeping that checkpoint for the resume. (One run for both: a run's start-up is most of it.)"""
    process = start(tmp_path, "model.path=tiny-llama", "steps=6", "rollout.offload=true")
    wait_for_step(tmp_path, process, 1)
    pid = json.loads((tmp_path / "logs" / "pids.json").read_text())["engines"][0]
    os.killpg(pid, signal.SIGKILL)  # the server and its scheduler/detokenizer workers
    wait_for_step(tmp_path, process, 3)
    records = metrics(tmp_path)
    assert [r["step"] for r in records[:3]] == [1, 2, 3]
    assert records[0]["rollout/engine_restarts"] == 0 and records[2]["rollout/engine_restarts"] == 1
    pids = json.loads((tmp_path / "logs" / "pids.json").read_text())
    assert pids["engines"][0] != pid
    deadline = time.monotonic() + 120
    # step 3's checkpoint follows its metrics (latest_checkpoint reads every file of it: once a poll)
    while (path := latest_checkpoint(tmp_path / "ckpt")) is None or read_meta(path)["step"] < 3:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.5)
    before = len((tmp_path / "out.log").read_text())
    os.kill(pids["trainers"][0], signal.SIGKILL)
    assert process.wait(timeout=300) == 1  # EXIT_FAILED
    out = (tmp_path / "out.log").read_text()[before:]
    assert "trainer rank 0 failed" in out and "resume from the last checkpoint" in out, out[-3000:]
    assert "restarting" not in out and "Traceback" not in out, out[-3000:]  # not blamed on an engine
    assert read_meta(latest_checkpoint(tmp_path / "ckpt"))["step"] >= 3  # kept for the resume
