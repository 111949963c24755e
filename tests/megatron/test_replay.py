"""Routing replay (R3) and routing capture in Megatron's routers (qurl_mcore/megatron/replay.py), on each tiny
MoE model (2 layers, 4 experts, top-2) at world size 1."""
import pytest
import torch

from qurl_mcore.megatron import build_gpt, load_hf_weights
from qurl_mcore.megatron.logprobs import token_logprobs
from qurl_mcore.megatron.replay import RoutingTaps
from qurl_mcore.models.tiny import tiny_checkpoint

from .helpers import random_ids

B, S = 2, 12


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def moe(request, megatron_ws1):
    path = tiny_checkpoint(request.param)
    model = build_gpt(path)
    load_hf_weights(model, path)
    return model


def _score(model, ids):
    """Summed log-probs and their gradient w.r.t. every parameter, and the routed experts [b, s, layers, k]."""
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model, ids, grad=True, return_routed_experts=True)
    out.logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), grads, out.routed_experts.permute(1, 2, 0, 3)


def _sets_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def test_taps_without_target_change_nothing_bitwise(moe):
    ids = random_ids(B, S, seed=5)
    before = _score(moe, ids)
    taps = RoutingTaps(moe)
    try:
        assert sorted(taps.taps) == [1, 2]  # global layer numbers of the MoE layers
        after = _score(moe, ids)
    finally:
        taps.replay(None)
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys() and all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert torch.equal(before[2], after[2])


def test_replaying_the_own_routing_is_bitwise_the_unreplayed_forward_and_backward(moe):
    ids = random_ids(B, S, seed=6)
    taps = RoutingTaps(moe)
    lp, grads, routes = _score(moe, ids)
    own = routes.clone()
    own[0, -3:] = -1  # rows without rollout routing keep the router's own choice
    taps.replay(own)
    try:
        lp2, grads2, routes2 = _score(moe, ids)
    finally:
        taps.replay(None)
    assert torch.equal(lp, lp2) and all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert _sets_equal(routes, routes2).all()


def test_replayed_experts_are_used_for_every_token_and_layer(moe):
    ids = random_ids(B, S, seed=7)
    _, _, own = _score(moe, ids)
    # a routing the router would not choose: the two experts it ranks lowest, for every token and layer
    taps = RoutingTaps(moe)
    target = torch.stack([torch.tensor([e for e in range(4) if e not in row.tolist()]) for row in own.reshape(-1, 2)])
    target = target.view_as(own)
    target[1, -1] = -1  # e.g. the last token of a sequence: the engine never forwards it
    taps.replay(target)
    try:
        lp, grads, routes = _score(moe, ids)
    finally:
        taps.replay(None)
    replayed = target >= 0
    assert _sets_equal(routes, target)[replayed.all(dim=-1)].all()
    assert _sets_equal(routes, own)[1, -1].all()  # the unreplayed token routed by itself
    # the router still learns: its gradient flows through the replayed experts' logits
    router_grads = [g for n, g in grads.items() if "router" in n]
    assert router_grads and all(g.abs().sum() > 0 for g in router_grads)


def _route_replayed(model, router, target: torch.Tensor):
    """(probs, routing map, logits) of `router` on 3 random tokens [s, b, h] replayed to `target` [3, k]."""
    taps = RoutingTaps(model)
    torch.manual_seed(0)
    hidden = torch.randn(3, 1, router.weight.shape[1])  # [s, b, h]
    taps.taps[router.layer_number].target = target
    try:
        with torch.no_grad():
            probs, routing_map = router(hidden)
            logits = torch.nn.functional.linear(hidden.view(3, -1), router.weight)
    finally:
        taps.replay(None)
    return probs, routing_map, logits


def test_gate_weights_are_the_trainer_softmax_over_the_replayed_experts(moe):
    """A router renormalising over the top-k (Qwen3-MoE, Mixtral: moe_router_pre_softmax False) weights a replayed
    token's experts by softmax(logits[replayed]) of the trainer's own router logits (hand formula), one that does
    not (Qwen2-MoE's default) by softmax(logits)[replayed]; zero elsewhere."""
    from megatron.core.transformer.moe.router import TopKRouter

    router = next(m for m in moe.modules() if isinstance(m, TopKRouter))
    target = torch.tensor([[2, 0], [1, 3], [0, 1]])
    probs, routing_map, logits = _route_replayed(moe, router, target)
    for t in range(3):
        expected = torch.zeros(4)
        pre_softmax = router.config.moe_router_pre_softmax
        expected[target[t]] = torch.softmax(logits[t], -1)[target[t]] if pre_softmax else \
            torch.softmax(logits[t, target[t]], dim=-1)
        assert torch.allclose(probs[t], expected, atol=1e-6), (t, probs[t], expected)
        assert routing_map[t].nonzero().flatten().tolist() == sorted(target[t].tolist())


def test_agreement_counts_the_masked_tokens_per_layer(moe):
    ids = random_ids(B, S, seed=8)
    _, _, own = _score(moe, ids)
    taps = RoutingTaps(moe)
    rollout = own.clone()
    rollout[0, 2, 1] = torch.roll(own[0, 2, 1], 1)  # same set, another order: counts as a match
    other = [e for e in range(4) if e not in own[1, 4, 0].tolist()]
    rollout[1, 4, 0, 0] = other[0]  # one expert of two differs in layer 1 at (1, 4)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, 2:6] = True  # 8 tokens
    with torch.no_grad():
        token_logprobs(moe, ids)
    sums = taps.agreement(rollout, mask, num_layers=2)
    assert sums.tolist() == [[8.0, 7.0, 7.5], [8.0, 8.0, 8.0]]


def test_a_biased_sigmoid_router_replays_with_its_unbiased_scores(megatron_ws1):
    """DeepSeek-V3's router (tiny-deepseek_v3: 8 experts in 4 groups, top-4 of the best 2 groups, a dense first
    layer) under R3: only the MoE layer has a tap, and a replayed token's experts get the trainer's unbiased
    sigmoid scores, renormalised over the replayed experts and multiplied by routed_scaling_factor (2.5) (hand
    formula), whatever the expert bias and the group limit would have chosen."""
    from megatron.core.transformer.moe.router import TopKRouter

    path = tiny_checkpoint("deepseek_v3")
    model = build_gpt(path)
    load_hf_weights(model, path)
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    assert sorted(RoutingTaps(model).taps) == [2]  # layer 1 is dense (first_k_dense_replace 1)
    target = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5], [0, 2, 4, 6]])  # the last two cross every group pair
    probs, routing_map, logits = _route_replayed(model, router, target)
    for t in range(3):
        scores = torch.sigmoid(logits[t])[target[t]]
        expected = torch.zeros(8)
        expected[target[t]] = scores / scores.sum() * 2.5
        assert torch.allclose(probs[t], expected, atol=1e-6), (t, probs[t], expected)
        assert routing_map[t].nonzero().flatten().tolist() == sorted(target[t].tolist())
