"""Faults across a node boundary: `qurl train` with the trainer on node 1 and the engine on node 2 (network
namespaces, tests/netns.py; layout disaggregated, weights by gloo broadcast, as test_e2e's two-node run).

- The engine's node crashes mid-run (every process in it killed: its Ray worker, the engine's host actor, the
  SGLang server): the engine cannot be restarted without its node, so the run stops at once with a message
  naming the engine and the node; once the node's Ray worker is back, the same command resumes from the last
  checkpoint and finishes.
- The link to the engine's node goes down while a weight broadcast is in flight (packets dropped, nothing
  reset, as behind a failed switch port): the push fails after `rollout.broadcast_timeout_s`, naming the
  engine and its address; the link stays down a little longer, the engine is restarted once Ray reaches its
  node again, and the step goes on.
  The bound itself (`broadcast._together`) is also tested on its own, in a fraction of a second.
"""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from qurl_mcore.checkpoint import latest_checkpoint
from qurl_mcore.rollout.broadcast import _together
from qurl_mcore.rollout.engine import WeightPushError
from tests.loop import runs

RESOURCES = {1: '{"qurl_train": 1}', 2: '{"qurl_rollout": 1}'}


def _train_command(head: str, run_dir: Path, *overrides: str) -> list[str]:
    command = runs.command(run_dir, "model.path=tiny-llama", "steps=2", "layout=disaggregated", *overrides)
    command[4:4] = ["--address", head]  # qurl train --address HEAD overrides...
    return command


def _until(done, process: subprocess.Popen, log: Path, timeout: float, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"nothing happened in {timeout:.0f} s: {log.read_text()[-3000:]}"
        time.sleep(poll)


@pytest.mark.slow
def test_a_crashed_engine_node_stops_the_run_naming_it_and_the_same_command_resumes(netns_nodes, tmp_path):
    nodes = netns_nodes(2)
    head = nodes.start_ray(RESOURCES, tmp_path)
    command = _train_command(head, tmp_path)
    log = tmp_path / "out.log"
    process = subprocess.Popen(nodes.command(1, *command), env=nodes.env, stdout=open(log, "ab"),
                               stderr=subprocess.STDOUT)
    _until(lambda: latest_checkpoint(tmp_path / "ckpt") is not None, process, log, timeout=400)  # step 1 saved
    nodes.kill(2)
    crashed = time.monotonic()
    assert process.wait(timeout=300) == 1, log.read_text()[-4000:]  # EXIT_FAILED
    stopped_after = time.monotonic() - crashed
    out = log.read_text()
    assert f"rollout engine 0 is gone with its host on node {nodes.addr(2)}: " in out, out[-4000:]
    assert "the run stopped; resume from the last checkpoint" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert [r["step"] for r in runs.metrics(tmp_path)] == [1]  # the crash came mid-run, in step 2

    nodes.start_ray_node(2, RESOURCES[2], head, tmp_path)  # the node is back
    nodes.wait_for_ray(head, 2, tmp_path)
    again = nodes.run(1, *command, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "resuming at step 1" in out, out[-4000:]
    assert [r["step"] for r in runs.metrics(tmp_path)] == [1, 2]
    print(f"the run stopped {stopped_after:.1f} s after node 2 crashed")


@pytest.mark.slow
def test_a_link_down_during_a_broadcast_fails_the_push_in_the_timeout_and_the_step_is_retried(netns_nodes,
                                                                                           tmp_path):
    timeout = 6.0
    nodes = netns_nodes(2)
    head = nodes.start_ray(RESOURCES, tmp_path)
    log = tmp_path / "out.log"
    process = subprocess.Popen(
        nodes.command(1, *_train_command(head, tmp_path, f"rollout.broadcast_timeout_s={timeout}")),
        env=nodes.env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    _until(lambda: runs.metrics(tmp_path), process, log, timeout=400)  # step 1 done: step 2's push is next
    # the push (about 25 MB, one bucket) is the first transfer to node 2 of a megabyte: cut the link in it
    counter = nodes.sent_to(2)
    start = int(counter.read_text())
    _until(lambda: int(counter.read_text()) - start > 1 << 20, process, log, timeout=120, poll=0.001)
    nodes.link(2, "down")
    cut = time.monotonic()
    try:
        _until(lambda: "failed: weight push" in log.read_text(), process, log, timeout=120)
        surfaced = time.monotonic() - cut
        time.sleep(3)  # the restart begins while Ray still cannot reach the node: it waits for the link
    finally:
        nodes.link(2, "up")
    assert process.wait(timeout=400) == 0, log.read_text()[-4000:]
    out = log.read_text()
    assert (f"rollout engine 0 failed: weight push: WeightPushError: engine 0 at http://{nodes.addr(2)}:"
            in out), out[-4000:]
    assert f"no answer for {timeout:g} s (the broadcast timeout" in out, out[-4000:]
    print(f"the push failed {surfaced:.1f} s after the link went down (rollout.broadcast_timeout_s={timeout:g})")
    assert timeout - 1 < surfaced < timeout + 10
    records = runs.metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["rollout/engine_restarts"] == 1  # the engine was restarted and step 2's push redone


def test_a_peer_that_never_answers_is_named_once_the_timeout_has_passed():
    """The sender's collective fails on its own timeout (as gloo's does); the engine's call, busy since the
    push began, is named as stalled then, without waiting for the call to end."""
    peer = "engine 0 at http://10.0.0.2:30000"
    release = threading.Event()
    threading.Timer(3.0, release.set).start()  # an unbounded wait fails the test instead of hanging it

    def sender():
        time.sleep(0.5)
        raise RuntimeError("Timed out waiting 500ms for send operation to complete")

    start = time.monotonic()
    with pytest.raises(WeightPushError, match=f"^{peer}: no answer for 0.5 s .*the link to it is down; the sender: "
                                              "RuntimeError: Timed out") as failure:
        _together(sender, [release.wait], [peer], 0.5)
    took = time.monotonic() - start
    release.set()
    assert failure.value.engine == 0 and 0.5 <= took < 0.9


def test_a_peer_that_keeps_making_progress_gets_more_than_the_timeout_in_all():
    since = [time.monotonic()]

    def slow_but_moving():
        for _ in range(6):
            time.sleep(0.1)
            since[0] = time.monotonic()

    start = time.monotonic()
    assert _together(lambda: "sent", [slow_but_moving], ["engine 0"], 0.25, since=since) == "sent"
    assert time.monotonic() - start >= 0.6  # twice the timeout, never 0.25 s without progress


def test_a_peer_that_fails_is_named_with_its_own_error():
    def refused():
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    with pytest.raises(WeightPushError, match="^engine 1 at http://10.0.0.3:1: ConnectionRefusedError: ") as failure:
        _together(lambda: None, [lambda: None, refused], ["engine 0", "engine 1 at http://10.0.0.3:1"], 5.0)
    assert failure.value.engine == 1
