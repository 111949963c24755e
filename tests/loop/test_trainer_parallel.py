"""The trainer at world size 2 over gloo (DP=2, TP=2, EP=2, PP=2), on Megatron's own DDP, optimizer and schedule,
each against the same step at world size 1: the same loss, gradient and update to fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.megatron.parallel import spawn

from . import workers

pytestmark = pytest.mark.slow  # two Megatron processes per case

CASES = {
    "dp2-dense": ("tiny-llama", ["train.dp_size=2"]),
    "tp2-dense": ("tiny-llama", ["train.tp_size=2"]),
    "dp2-moe": ("tiny-qwen3_moe", ["train.dp_size=2"]),
    "ep2-moe": ("tiny-qwen3_moe", ["train.dp_size=2", "train.ep_size=2"]),
    "pp2-dense": ("tiny-llama", ["train.pp_size=2"]),
    "pp2-moe": ("tiny-qwen3_moe", ["train.pp_size=2"]),
    # routing replay: each stage replays its own layers' part of the engine's routing
    "pp2-moe-r3": ("tiny-qwen3_moe", ["train.pp_size=2", "train.routing_replay=r3"]),
}
REPLAY = "train.routing_replay=r3"


def _reference_key(model: str, overrides: list[str]) -> tuple[str, bool]:
    return model, REPLAY in overrides


@pytest.fixture(scope="module")
def reference():
    keys = {_reference_key(m, o) for m, o in CASES.values()}
    return {(model, r3): spawn(workers.train_step, 1, 1, [f"model.path={model}", *([REPLAY] if r3 else [])])[0]
            for model, r3 in keys}


def test_routing_replay_changes_the_step_and_measures_before_it(reference):
    plain, replayed = reference[("tiny-qwen3_moe", False)], reference[("tiny-qwen3_moe", True)]
    # the random routing was used: other experts got gradient (the loss value is -mean(A) at the first step
    # whatever the routing, its gradient is not)
    changed = [n for n, g in plain["grads"].items()
               if not torch.allclose(replayed["grads"][n], g, rtol=1e-3, atol=1e-7)]
    assert any(".mlp.experts." in n for n in changed), changed
    for key in ("mismatch/topk_match", "mismatch/topk_overlap", "mismatch/topk_match/layer2"):
        # measured without replay and before the update: the same with and without R3
        assert replayed["metrics"][key] == plain["metrics"][key], key
    assert 0 <= plain["metrics"]["mismatch/topk_match"] < 0.5  # random routing rarely agrees with the router


@pytest.mark.parametrize("case", list(CASES))
def test_world_size_2_equals_world_size_1(reference, case):
    model, overrides = CASES[case]
    ref = reference[_reference_key(model, overrides)]
    results = spawn(workers.train_step, 2, 2, [f"model.path={model}", *overrides])
    got = results[0]
    for key in ("loss/total", "loss/policy", "train/grad_norm", *(("mismatch/topk_match",) if "moe" in case else ())):
        for r in results:  # every rank reports the whole batch's value
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["grads"].keys() == ref["grads"].keys()
    scale = max(g.abs().max() for g in ref["grads"].values())
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)
    for name, w in ref["weights"].items():
        moved = (got["weights"][name] - w).abs()
        # Adam's first step is ±lr wherever the gradient is not ~0; rounding may flip a step where it is
        assert (moved > 1e-6).float().mean() < 0.01, name
