"""Atomic checkpoints and RNG capture."""
import os
import random
import signal

import numpy as np
import pytest
import torch

from qurl_mcore.loop.checkpoint import (
    StopRequest, finalize, latest_checkpoint, list_checkpoints, read_rank, rng_state, set_rng_state, write_rank,
)


def test_publish_read_and_keep_newest(tmp_path):
    for step in (5, 10, 15):
        for rank in range(2):
            write_rank(tmp_path, step, rank, {"w": torch.full((3,), float(step + rank)), "pos": step * 8})
        finalize(tmp_path, step, 2, {"config": {"lr": 1e-6}}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000015"]
    meta, state = read_rank(latest_checkpoint(tmp_path), 1)
    assert meta["step"] == 15 and meta["world_size"] == 2 and meta["config"] == {"lr": 1e-6}
    assert torch.equal(state["w"], torch.full((3,), 16.0)) and state["pos"] == 120


def test_a_crash_before_publishing_leaves_the_previous_checkpoint(tmp_path):
    write_rank(tmp_path, 1, 0, {"x": 1})
    finalize(tmp_path, 1, 1, {})
    write_rank(tmp_path, 2, 0, {"x": 2})  # crash here: step 2 never finalized
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(RuntimeError, match=r"lacks the files of ranks \[1\]"):
        finalize(tmp_path, 2, 2, {})
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_sigterm_becomes_a_flag():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopRequest()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, previous)
