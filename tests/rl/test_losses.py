import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from qurl_mcore.rl.losses import LOSSES, aggregate, policy_loss

# Expected values below are worked out by hand from the probabilities, with eps_low = eps_high = 0.2 unless a case
# says otherwise. Each row: probabilities (π_θ, π_prox, π_behav) of one token, advantage, keyword overrides,
# expected loss (= −objective) and expected d loss / d log π_θ.
# Settings used:  S1 (0.55, 0.5, 0.4):   R = 1.1, r = 1.25, ρ = rR = 1.375
#                 S2 (0.45, 0.5, 0.625): R = 0.9, r = 0.8,  ρ = 0.72
#                 S3 (0.65, 0.5, 0.5):   R = 1.3, r = 1
#                 S4 (0.35, 0.5, 0.5):   R = 0.7, r = 1
#                 S5 (0.65, 0.5, 0.25):  R = 1.3, r = 2,    ρ = 2.6
#                 S7 (0.7, 0.5, 0.625):  R = 1.4, r = 0.8,  ρ = 1.12
#                 S8 (0.25, 0.5, 0.25):  R = 0.5, r = 2,    ρ = 1
S1 = (0.55, 0.5, 0.4)
S2 = (0.45, 0.5, 0.625)
S3 = (0.65, 0.5, 0.5)
S4 = (0.35, 0.5, 0.5)
S5 = (0.65, 0.5, 0.25)
S7 = (0.7, 0.5, 0.625)
S8 = (0.25, 0.5, 0.25)
HAND_CASES = [
    # ppo: min(R·A, clip(R)·A); π_behav plays no part.
    ("ppo", S1, +1, {}, -1.1, -1.1),  # R inside [0.8, 1.2]: J = 1.1, dJ/dlogπ = R·A
    ("ppo", S1, -1, {}, 1.1, 1.1),
    ("ppo", S3, +1, {}, -1.2, 0.0),  # R = 1.3 > 1.2: J = 1.2, flat
    ("ppo", S3, -1, {}, 1.3, 1.3),  # min(−1.3, −1.2) = −1.3: unclipped branch
    ("ppo", S4, +1, {}, -0.7, -0.7),  # min(0.7, 0.8) = 0.7
    ("ppo", S4, -1, {}, 0.8, 0.0),  # min(−0.7, −0.8) = −0.8, flat
    ("ppo", S3, +1, {"eps_high": 0.28}, -1.28, 0.0),  # DAPO clip-higher: cap 1.28
    ("ppo", (0.625, 0.5, 0.5), +1, {"eps_high": 0.28}, -1.25, -1.25),  # R = 1.25 < 1.28: not clipped
    ("ppo", (0.375, 0.5, 0.5), -1, {"eps_low": 0.3}, 0.75, 0.75),  # R = 0.75 > 0.7: not clipped
    # naive: clip on ρ = π_θ/π_behav.
    ("naive", S1, +1, {}, -1.2, 0.0),  # ρ = 1.375 > 1.2: J = 1.2, flat
    ("naive", S1, -1, {}, 1.375, 1.375),  # min(−1.375, −1.2) = −1.375
    ("naive", S2, +1, {}, -0.72, -0.72),  # ρ = 0.72: min(0.72, 0.8) = 0.72
    ("naive", S2, -1, {}, 0.8, 0.0),  # min(−0.72, −0.8) = −0.8, flat
    # decoupled: r·min(R·A, clip(R)·A).
    ("decoupled", S1, +1, {}, -1.375, -1.375),  # 1.25·1.1
    ("decoupled", S1, -1, {}, 1.375, 1.375),
    ("decoupled", S5, +1, {}, -2.4, 0.0),  # 2·1.2, flat
    ("decoupled", S5, -1, {}, 2.6, 2.6),  # 2·(−1.3)
    # tis: min(r, C)·min(R·A, clip(R)·A).
    ("tis", S1, +1, {}, -1.375, -1.375),  # r = 1.25 < C = 2: as decoupled
    ("tis", S5, +1, {"tis_cap": 1.5}, -1.8, 0.0),  # 1.5·1.2
    ("tis", S5, -1, {"tis_cap": 1.5}, 1.95, 1.95),  # 1.5·(−1.3)
    # mis: r·min(...) if r ∈ [1/C, C] else 0.
    ("mis", S1, -1, {}, 1.375, 1.375),  # r = 1.25 inside [0.5, 2]
    ("mis", S5, +1, {"tis_cap": 1.5}, 0.0, 0.0),  # r = 2 > 1.5: dropped
    ("mis", S2, +1, {"tis_cap": 1.2}, 0.0, 0.0),  # r = 0.8 < 1/1.2: dropped
    ("mis", S5, -1, {"tis_cap": 3.0}, 2.6, 2.6),  # r = 2 inside [1/3, 3]
    # acr: min(r, C)·min(R·A, clip(R, 0.8, u)·A), u = max(0.8, 1.2/r).
    ("acr", S1, +1, {}, -1.2, 0.0),  # u = 0.96 < R = 1.1: J = 1.25·0.96 = 1.2, flat (decoupled is not)
    ("acr", S1, -1, {}, 1.375, 1.375),  # min(−1.1, −0.96) = −1.1: J = −1.375
    ("acr", S2, +1, {}, -0.72, -0.72),  # u = 1.5, R = 0.9 inside: J = 0.8·0.9
    ("acr", S2, -1, {}, 0.72, 0.72),
    ("acr", S7, +1, {}, -1.12, -1.12),  # u = 1.5 > R = 1.4 (ppo would clip at 1.2): J = 0.8·1.4
    ("acr", S5, +1, {"tis_cap": 3.0}, -1.6, 0.0),  # u = max(0.8, 0.6) = 0.8: J = 2·0.8, flat
    ("acr", S5, -1, {"tis_cap": 3.0}, 2.6, 2.6),  # min(−1.3, −0.8) = −1.3: J = 2·(−1.3)
    ("acr", S5, +1, {"tis_cap": 1.5}, -1.2, 0.0),  # weight truncated to 1.5: J = 1.5·0.8
    # acr_symmetric: min(r, C)·min(R·A, clip(R, 0.8/r, 1.2/r)·A).
    ("acr_symmetric", S1, +1, {}, -1.2, 0.0),  # [0.64, 0.96]: as acr
    ("acr_symmetric", S1, -1, {}, 1.375, 1.375),
    ("acr_symmetric", S2, +1, {}, -0.72, -0.72),  # [1.0, 1.5], R = 0.9: min(0.9, 1.0) = 0.9, J = 0.72
    ("acr_symmetric", S2, -1, {}, 0.8, 0.0),  # min(−0.9, −1.0) = −1.0: J = 0.8·(−1.0), flat (acr is not)
    ("acr_symmetric", S5, +1, {"tis_cap": 1.5}, -0.9, 0.0),  # [0.4, 0.6] (r = 2, not C): J = 1.5·0.6, flat
    ("acr_symmetric", S8, -1, {"tis_cap": 1.5}, 0.75, 0.75),  # [0.4, 0.6], R = 0.5 inside: J = 1.5·(−0.5)
    # acr_trunc: r̃ = min(r, C), r̃·min(R·A, clip(R, 0.8/r̃, 1.2/r̃)·A) = min(ρ̃·A, clip(ρ̃)·A), ρ̃ = r̃R.
    ("acr_trunc", S1, +1, {}, -1.2, 0.0),  # r̃ = r = 1.25: [0.64, 0.96], R = 1.1 above: J = 1.25·0.96
    ("acr_trunc", S1, -1, {}, 1.375, 1.375),  # min(−1.1, −0.96) = −1.1: J = 1.25·(−1.1)
    ("acr_trunc", S5, +1, {"tis_cap": 1.5}, -1.2, 0.0),  # r̃ = 1.5: [0.533, 0.8], R = 1.3: J = 1.5·0.8, flat
    ("acr_trunc", S5, -1, {"tis_cap": 1.5}, 1.95, 1.95),  # min(−1.3, −0.8) = −1.3: J = 1.5·(−1.3)
    ("acr_trunc", S8, -1, {"tis_cap": 1.5}, 0.8, 0.0),  # R = 0.5 < 0.8/1.5: min(−0.5, −0.533): J = −0.8, flat
]


def _tensor(values, dtype=torch.float64):
    return torch.tensor([values], dtype=dtype)


def _run(method, theta, prox, behav, adv, **kw):
    """One sequence of tokens given by probabilities; returns loss, d loss/d log π_θ and the metrics."""
    logprobs = _tensor(theta).log().requires_grad_()
    prox, behav, adv = _tensor(prox).log(), _tensor(behav).log(), _tensor(adv)
    loss, metrics = policy_loss(logprobs, prox, behav, adv, torch.ones(1, len(theta)), method=method, **kw)
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), metrics


@pytest.mark.parametrize("method, probs, adv, kw, want_loss, want_grad", HAND_CASES)
def test_hand_computed_single_token(method, probs, adv, kw, want_loss, want_grad):
    theta, prox, behav = probs
    loss, grad, _ = _run(method, [theta], [prox], [behav], [float(adv)], **kw)
    assert loss == pytest.approx(want_loss, abs=1e-12)
    assert grad[0] == pytest.approx(want_grad, abs=1e-12)


def test_every_method_has_hand_cases_for_both_advantage_signs():
    covered = {(m, a) for m, _, a, *_ in HAND_CASES}
    assert covered == {(m, a) for m in LOSSES for a in (+1, -1)}


def test_mis_keeps_dropped_tokens_in_the_normaliser():
    # Tokens S1 (r = 1.25), S5 (r = 2) and (0.5, 0.5, 1.0) (r = 0.5), C = 1.5: only S1 survives,
    # J = [1.25·1.1·A, 0, 0], token_mean divides by 3.
    theta, prox, behav = [0.55, 0.65, 0.5], [0.5, 0.5, 0.5], [0.4, 0.25, 1.0]
    loss, grad, metrics = _run("mis", theta, prox, behav, [-1.0, -1.0, -1.0], tis_cap=1.5)
    assert loss == pytest.approx(1.375 / 3, abs=1e-12)
    assert grad == pytest.approx([1.375 / 3, 0.0, 0.0], abs=1e-12)
    # r = [1.25, 2, 0.5]: mean 1.25, max 2; r > 1.5 for one token, r outside [2/3, 1.5] for two.
    assert metrics["is_ratio/mean"] == pytest.approx(1.25)
    assert metrics["is_ratio/max"] == pytest.approx(2.0)
    assert metrics["is_ratio/truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["is_ratio/masked_frac"] == pytest.approx(2 / 3)


def test_metrics_are_hand_checked_floats():
    # ppo tokens: S3 with A = +1 (clipped high), S4 with A = −1 (clipped low), S1 with A = +1 (inside),
    # S3 with A = 0 (no gradient either way, not counted as clipped).
    theta, prox, behav = [0.65, 0.35, 0.55, 0.65], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.4, 0.5]
    _, _, metrics = _run("ppo", theta, prox, behav, [1.0, -1.0, 1.0, 0.0])
    assert all(type(v) is float for v in metrics.values())
    assert set(metrics) == {
        "loss/total",
        "loss/policy",
        "clip_frac/low",
        "clip_frac/high",
        "is_ratio/mean",
        "is_ratio/max",
        "is_ratio/truncated_frac",
        "is_ratio/masked_frac",
        "mismatch/kl_k1",
        "mismatch/kl_k3",
        "mismatch/abs_logprob_diff",
        "mismatch/prob_pearson",
    }
    assert metrics["clip_frac/low"] == 0.25
    assert metrics["clip_frac/high"] == 0.25
    # J = [1.2, −0.8, 1.1, 0] → loss = −1.5/4
    assert metrics["loss/policy"] == pytest.approx(-1.5 / 4)
    assert metrics["loss/total"] == metrics["loss/policy"]
    # log(behav/prox) = [0, 0, log 0.8, 0]; ρ = prox/behav = 1.25 on token 3.
    assert metrics["mismatch/kl_k1"] == pytest.approx(math.log(0.8) / 4)
    assert metrics["mismatch/kl_k3"] == pytest.approx((0.25 - math.log(1.25)) / 4)
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(math.log(1.25) / 4)
    # prox probabilities are constant: the correlation is undefined.
    assert math.isnan(metrics["mismatch/prob_pearson"])


def test_acr_clip_fraction_uses_the_adaptive_bound():
    # S1 under acr, A = +1: R = 1.1 exceeds u = 0.96 although it is inside ppo's [0.8, 1.2].
    _, _, acr = _run("acr", [0.55], [0.5], [0.4], [1.0])
    _, _, ppo = _run("ppo", [0.55], [0.5], [0.4], [1.0])
    assert (acr["clip_frac/high"], ppo["clip_frac/high"]) == (1.0, 0.0)


def test_mismatch_pearson_in_loss_metrics():
    # prox probabilities [0.2, 0.4, 0.6] and behav [0.1, 0.3, 0.8]: centred x = [−0.2, 0, 0.2],
    # y = [−0.3, −0.1, 0.4]; r = (0.06 + 0.08) / sqrt(0.08 · 0.26).
    _, _, metrics = _run("decoupled", [0.2, 0.4, 0.6], [0.2, 0.4, 0.6], [0.1, 0.3, 0.8], [1.0, 1.0, 1.0])
    assert metrics["mismatch/prob_pearson"] == pytest.approx(0.14 / math.sqrt(0.08 * 0.26))


# --- aggregation -----------------------------------------------------------------------------------------------
# With π_θ = π_prox = π_behav every ratio is 1 and the ppo objective per token is just A.
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
AGG_ADV = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]], dtype=torch.float64)
AGG_CASES = [
    # sum 10 over 4 tokens
    ("token_mean", -10 / 4, [[-1 / 4, -2 / 4, -3 / 4, 0], [-4 / 4, 0, 0, 0], [0, 0, 0, 0]]),
    # sequence means 2 and 4; the empty third sequence is left out
    ("seq_mean_token_mean", -(2 + 4) / 2, [[-1 / 6, -2 / 6, -3 / 6, 0], [-4 / 2, 0, 0, 0], [0, 0, 0, 0]]),
    # sequence sums 6, 4, 0 over all three sequences
    ("seq_mean_token_sum", -(6 + 4 + 0) / 3, [[-1 / 3, -2 / 3, -3 / 3, 0], [-4 / 3, 0, 0, 0], [0, 0, 0, 0]]),
]


@pytest.mark.parametrize("agg, want_loss, want_grad", AGG_CASES)
def test_aggregation_modes(agg, want_loss, want_grad):
    logprobs = torch.full((3, 4), math.log(0.5), dtype=torch.float64, requires_grad=True)
    same = logprobs.detach().clone()
    loss, _ = policy_loss(logprobs, same, same, AGG_ADV, AGG_MASK, method="ppo", agg=agg)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss)
    np.testing.assert_allclose(logprobs.grad.numpy(), np.array(want_grad), atol=1e-12)


def test_aggregate_rejects_an_all_empty_batch_and_unknown_modes():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match="no tokens"):
        aggregate(values, torch.zeros(2, 3), "seq_mean_token_mean")
    with pytest.raises(ValueError, match="unknown agg"):
        aggregate(values, torch.ones(2, 3), "sum")


def test_sequence_advantages_broadcast_over_tokens():
    g = torch.Generator().manual_seed(1)
    lp, prox, behav = (-torch.rand(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 5)
    kw = dict(method="acr", agg="seq_mean_token_mean")
    a, _ = policy_loss(lp, prox, behav, adv, mask, **kw)
    b, _ = policy_loss(lp, prox, behav, adv[:, None].expand(3, 5), mask, **kw)
    c, _ = policy_loss(lp, prox, behav, adv.flip(0)[:, None].expand(3, 5), mask, **kw)  # the wrong sequences
    assert a.item() == b.item() != c.item()


# --- KL and entropy terms -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, want_kl, want_grad",
    [
        # π_θ = 0.5, π_ref = 0.25. k1 = log(0.5/0.25) = log 2, d/dlogπ_θ = 1.
        ("k1", math.log(2), 1.0),
        # ρ = π_ref/π_θ = 0.5: k3 = (ρ − 1) − log ρ = −0.5 + log 2, d/dlogπ_θ = 1 − ρ = 0.5.
        ("k3", math.log(2) - 0.5, 0.5),
    ],
)
def test_kl_penalty(estimator, want_kl, want_grad):
    logprobs = torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    same = logprobs.detach().clone()
    # A = 0 silences the policy term, leaving kl_coef·KL.
    loss, metrics = policy_loss(
        logprobs, same, same, torch.zeros(1), torch.ones(1, 2), method="ppo",
        ref_logprobs=ref, kl_coef=0.1, kl_estimator=estimator,
    )  # fmt: skip
    loss.backward()
    assert metrics["kl_ref"] == pytest.approx(want_kl)
    assert loss.item() == pytest.approx(0.1 * want_kl)
    assert metrics["loss/total"] == pytest.approx(0.1 * want_kl)
    assert logprobs.grad[0].tolist() == pytest.approx([0.1 * want_grad / 2] * 2)


def test_entropy_bonus():
    logprobs = torch.full((1, 3), math.log(0.5), dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 50.0]], dtype=torch.float64, requires_grad=True)
    same = logprobs.detach().clone()
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = policy_loss(
        logprobs, same, same, torch.zeros(1), mask, method="ppo", entropy=entropy, entropy_coef=0.01
    )
    loss.backward()
    assert metrics["entropy"] == pytest.approx(1.5)
    assert loss.item() == pytest.approx(-0.015)
    assert entropy.grad[0].tolist() == pytest.approx([-0.005, -0.005, 0.0])


# --- identities -----------------------------------------------------------------------------------------------

finite_logprob = st.floats(-4.0, 0.0, allow_nan=False)


@st.composite
def batches(draw, max_batch=3, max_seq=5):
    """Random [batch, seq] inputs with at least one response token."""
    b = draw(st.integers(1, max_batch))
    t = draw(st.integers(1, max_seq))

    def grid(elements):
        return torch.tensor(draw(st.lists(st.lists(elements, min_size=t, max_size=t), min_size=b, max_size=b)),
                            dtype=torch.float64)  # fmt: skip

    mask = grid(st.sampled_from([0.0, 1.0]))
    mask[draw(st.integers(0, b - 1)), draw(st.integers(0, t - 1))] = 1.0
    return dict(
        logprobs=grid(finite_logprob),
        prox=grid(finite_logprob),
        behav=grid(finite_logprob),
        adv=grid(st.floats(-2.0, 2.0, allow_nan=False)),
        mask=mask,
        eps_low=draw(st.sampled_from([0.1, 0.2])),
        eps_high=draw(st.sampled_from([0.2, 0.28])),
        agg=draw(st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])),
    )


def _loss_and_grad(d, method, prox, behav, **kw):
    logprobs = d["logprobs"].clone().requires_grad_()
    loss, metrics = policy_loss(
        logprobs, prox, behav, d["adv"], d["mask"], method=method,
        eps_low=d["eps_low"], eps_high=d["eps_high"], agg=d["agg"], **kw,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


@settings(max_examples=60, deadline=None)
@given(d=batches(), method=st.sampled_from(["decoupled", "tis", "mis", "acr", "acr_symmetric", "acr_trunc"]))
def test_off_policy_methods_reduce_to_ppo_when_behav_equals_prox(d, method):
    want_loss, want_grad, _ = _loss_and_grad(d, "ppo", d["prox"], d["prox"])
    loss, grad, _ = _loss_and_grad(d, method, d["prox"], d["prox"])
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(d=batches())
def test_tis_with_infinite_cap_is_decoupled(d):
    want_loss, want_grad, _ = _loss_and_grad(d, "decoupled", d["prox"], d["behav"])
    loss, grad, _ = _loss_and_grad(d, "tis", d["prox"], d["behav"], tis_cap=math.inf)
    mis_loss, mis_grad, _ = _loss_and_grad(d, "mis", d["prox"], d["behav"], tis_cap=math.inf)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(mis_loss, want_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(mis_grad, want_grad, rtol=0, atol=1e-12)


def test_tis_actually_truncates():
    # Guards the identity above against a `tis` that ignores its cap: with r = 2 and C = 1.5 they must differ.
    a, *_ = _run("tis", [0.55], [0.5], [0.25], [1.0], tis_cap=1.5)
    b, *_ = _run("decoupled", [0.55], [0.5], [0.25], [1.0])
    assert a == pytest.approx(-1.5 * 1.1) and b == pytest.approx(-2 * 1.1)


def test_acr_symmetric_is_naive_while_r_is_under_the_cap():
    # r·clip(R, l/r, u/r) = clip(rR, l, u), so the symmetric reading of ACR is the naive objective (see docstring).
    g = torch.Generator().manual_seed(2)
    prox = -torch.rand(4, 16, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(4, 16, generator=g, dtype=torch.float64)
    d = dict(logprobs=prox + 0.3 * torch.randn(4, 16, generator=g, dtype=torch.float64),
             adv=torch.randn(4, 16, generator=g, dtype=torch.float64), mask=torch.ones(4, 16),
             eps_low=0.2, eps_high=0.28, agg="token_mean")  # fmt: skip
    want_loss, want_grad, _ = _loss_and_grad(d, "naive", prox, behav)
    loss, grad, _ = _loss_and_grad(d, "acr_symmetric", prox, behav, tis_cap=math.inf)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    assert (want_grad == 0).any() and (want_grad != 0).any()


@settings(max_examples=60, deadline=None)
@given(d=batches(), cap=st.sampled_from([1.0, 1.25, 2.0, 5.0]))
def test_acr_trunc_is_naive_on_the_truncated_behaviour_policy(d, cap):
    # QuRL §4.2: π_behav^trunc = max(π_behav, π_prox/C); clipping ρ̃ = π_θ/π_behav^trunc to [1 − eps_low, 1 + eps_high]
    # is the naive objective with π_behav^trunc in place of π_behav.
    truncated = torch.maximum(d["behav"], d["prox"] - math.log(cap))
    want_loss, want_grad, _ = _loss_and_grad(d, "naive", d["prox"], truncated)
    loss, grad, _ = _loss_and_grad(d, "acr_trunc", d["prox"], d["behav"], tis_cap=cap)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_acr_symmetric_and_acr_trunc_share_their_gradient_while_R_is_above_the_truncated_bound():
    # Where r > C both weigh by C and clip R at an upper bound, (1 + eps_high)/r and (1 + eps_high)/C: while
    # R > (1 + eps_high)/C an A > 0 token is flat in both and an A < 0 token keeps C·R·A in both (its lower bounds
    # are below R). Only the loss value differs, by the flat tokens' constants C·u·A.
    g = torch.Generator().manual_seed(3)
    cap, eps_low, eps_high = 2.0, 0.2, 0.28
    prox = -1.0 - torch.rand(1, 64, generator=g, dtype=torch.float64)
    behav = prox - torch.empty(1, 64, dtype=torch.float64).uniform_(math.log(2.5), math.log(6.0), generator=g)
    ratio = torch.empty(1, 64, dtype=torch.float64).uniform_((1 + eps_high) / cap + 0.01, 2.0, generator=g)
    d = dict(logprobs=prox + ratio.log(), adv=torch.randn(1, 64, generator=g, dtype=torch.float64),
             mask=torch.ones(1, 64), eps_low=eps_low, eps_high=eps_high, agg="token_mean")  # fmt: skip
    sym_loss, sym_grad, _ = _loss_and_grad(d, "acr_symmetric", prox, behav, tis_cap=cap)
    trunc_loss, trunc_grad, _ = _loss_and_grad(d, "acr_trunc", prox, behav, tis_cap=cap)
    want = torch.where(d["adv"] < 0, cap * ratio * d["adv"], 0.0) / -64  # dJ/dlog π = C·R·A, loss = −mean J
    torch.testing.assert_close(sym_grad, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(trunc_grad, want, rtol=1e-12, atol=1e-15)
    assert sym_loss != trunc_loss
    # Below the bound they part: r = 4, R = 0.5, A = 1 is flat for acr_symmetric (0.5 > 1.28/4) and not for
    # acr_trunc (0.5 inside [0.4, 0.64]).
    sym = _run("acr_symmetric", [0.125], [0.25], [0.0625], [1.0], tis_cap=cap, eps_high=eps_high)
    trunc = _run("acr_trunc", [0.125], [0.25], [0.0625], [1.0], tis_cap=cap, eps_high=eps_high)
    assert sym[1][0] == pytest.approx(0.0) and trunc[1][0] == pytest.approx(-cap * 0.5)


@settings(max_examples=60, deadline=None)
@given(d=batches(max_batch=4, max_seq=8))
def test_acr_caps_the_ratio_to_the_behaviour_policy(d):
    # For A > 0 the gradient vanishes exactly where ρ = π_θ/π_behav > 1 + eps_high and R > 1 − eps_low
    # (the second condition only matters when r > (1 + eps_high)/(1 − eps_low), where u floors at 1 − eps_low).
    d["adv"] = d["adv"].abs() + 0.1
    d["mask"] = torch.ones_like(d["mask"])
    _, grad, _ = _loss_and_grad(d, "acr", d["prox"], d["behav"], tis_cap=math.inf)
    rho = (d["logprobs"] - d["behav"]).exp()
    ratio = (d["logprobs"] - d["prox"]).exp()
    # keep away from the boundaries, where rounding decides
    decided = ((rho - (1 + d["eps_high"])).abs() > 1e-9) & ((ratio - (1 - d["eps_low"])).abs() > 1e-9)
    capped = (rho > 1 + d["eps_high"]) & (ratio > 1 - d["eps_low"])
    assert torch.equal((grad == 0)[decided], capped[decided])


def test_acr_cap_floor_when_r_is_large():
    # r = 3, R = 0.5: ρ = 1.5 > 1.2 but u = max(0.8, 0.4) = 0.8 > R, so the token still learns:
    # J = min(3, C=4)·0.5·A, d loss/dlogπ = −1.5.
    loss, grad, _ = _run("acr", [0.25], [0.5], [0.5 / 3], [1.0], tis_cap=4.0)
    assert loss == pytest.approx(-1.5) and grad[0] == pytest.approx(-1.5)


# --- masks ----------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    d=batches(),
    method=st.sampled_from(LOSSES),
    garbage=st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 7.0]),
    per_sequence_adv=st.booleans(),
)
def test_padding_values_change_nothing(d, method, garbage, per_sequence_adv):
    mask = d["mask"].bool()
    adv = d["adv"][:, 0].clone() if per_sequence_adv else d["adv"]
    ref = d["behav"] - 0.1
    entropy = d["prox"].neg()

    def run(fill):
        def dirty(x):
            return torch.where(mask, x, fill) if x.shape == mask.shape else x

        logprobs = dirty(d["logprobs"]).requires_grad_()
        a = torch.where(mask.any(-1), adv, fill) if per_sequence_adv else dirty(adv)
        loss, metrics = policy_loss(
            logprobs, dirty(d["prox"]), dirty(d["behav"]), a, d["mask"], method=method, agg=d["agg"],
            ref_logprobs=dirty(ref), kl_coef=0.01, entropy=dirty(entropy), entropy_coef=0.001,
        )  # fmt: skip
        loss.backward()
        return loss.detach(), logprobs.grad, metrics

    clean_loss, clean_grad, clean_metrics = run(0.0)
    loss, grad, metrics = run(garbage)
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    assert (grad[~mask] == 0).all()
    assert metrics.keys() == clean_metrics.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(clean_metrics[k], nan_ok=True, rel=0, abs=0), k


# --- validation -----------------------------------------------------------------------------------------------


def _valid_inputs():
    lp = torch.full((2, 3), -1.0)
    return dict(logprobs=lp, prox_logprobs=lp.clone(), behav_logprobs=lp.clone(), advantages=torch.ones(2),
                mask=torch.ones(2, 3))  # fmt: skip


def _with(**changes):
    kw = _valid_inputs()
    for k, v in changes.items():
        kw[k] = v(kw[k]) if callable(v) else v
    return kw


def _nan_at(x, idx):
    x = x.clone()
    x[idx] = math.nan
    return x


BAD_INPUTS = [
    (_with(), dict(method="grpo"), "unknown method 'grpo'"),
    (_with(), dict(method="ppo", agg="mean"), "unknown agg 'mean'"),
    (_with(), dict(method="ppo", kl_estimator="k2"), "unknown kl_estimator"),
    (_with(), dict(method="ppo", eps_low=1.0), "eps_low"),
    (_with(), dict(method="ppo", eps_high=-0.1), "eps_high"),
    (_with(), dict(method="tis", tis_cap=0.5), "tis_cap"),
    (_with(), dict(method="tis", tis_cap=math.nan), "tis_cap"),
    (_with(), dict(method="ppo", kl_coef=1e-3), "ref_logprobs is None"),
    (_with(), dict(method="ppo", entropy_coef=1e-3), "entropy is None"),
    (_with(logprobs=torch.zeros(6)), dict(method="ppo"), r"\[batch, seq\]"),
    (_with(prox_logprobs=torch.zeros(2, 4)), dict(method="ppo"), "prox_logprobs has shape"),
    (_with(behav_logprobs=torch.zeros(3, 3)), dict(method="ppo"), "behav_logprobs has shape"),
    (_with(advantages=torch.zeros(3)), dict(method="ppo"), "advantages has shape"),
    (_with(mask=torch.ones(2, 4)), dict(method="ppo"), "mask has shape"),
    (_with(mask=torch.full((2, 3), 2.0)), dict(method="ppo"), "0/1"),
    (_with(mask=torch.zeros(2, 3)), dict(method="ppo"), "no response tokens"),
    (_with(behav_logprobs=lambda x: _nan_at(x, (1, 2))), dict(method="tis"), r"behav_logprobs has 1 non-fin.*\[1, 2\]"),
    (_with(logprobs=lambda x: _nan_at(x, (0, 0))), dict(method="ppo"), "logprobs has 1 non-finite"),
    (_with(advantages=torch.tensor([1.0, math.inf])), dict(method="ppo"), "advantages has 3 non-finite"),
    (_with(), dict(method="ppo", ref_logprobs=torch.zeros(2, 2)), "ref_logprobs has shape"),
    (_with(), dict(method="ppo", entropy=torch.full((2, 3), math.nan)), "entropy has 6 non-finite"),
]


@pytest.mark.parametrize("inputs, options, message", BAD_INPUTS)
def test_bad_inputs_raise(inputs, options, message):
    with pytest.raises(ValueError, match=message):
        policy_loss(**inputs, **options)


def test_valid_inputs_pass():
    # The baseline every BAD_INPUTS case deviates from must itself be accepted.
    loss, _ = policy_loss(**_valid_inputs(), method="ppo")
    assert loss.item() == pytest.approx(-1.0)


def test_low_precision_logprobs_are_computed_in_float32():
    g = torch.Generator().manual_seed(3)
    lp, prox, behav = (-torch.rand(2, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    args = (torch.tensor([1.0, -1.0]), torch.ones(2, 8))
    loss, _ = policy_loss(lp, prox, behav, *args, method="acr")
    want, _ = policy_loss(lp.float(), prox.float(), behav.float(), *args, method="acr")
    assert loss.dtype == torch.float32 and loss.item() == want.item()
