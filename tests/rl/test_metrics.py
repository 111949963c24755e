import math

import hypothesis.strategies as st
import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings

from qurl_mcore.rl import metrics as M


def _random_tokens(seed, shape=(4, 7), spread=0.5):
    """Rollout/train log-probs that differ a little, a mask, and the same tensors with NaN garbage in the padding."""
    g = torch.Generator().manual_seed(seed)
    train = -3 * torch.rand(shape, generator=g, dtype=torch.float64)
    rollout = (train + spread * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(max=0)
    mask = torch.rand(shape, generator=g) < 0.7
    mask[0, 0] = True
    dirty = [torch.where(mask, x, math.nan) for x in (train, rollout)]
    return train, rollout, mask, dirty


@pytest.mark.parametrize("seed", range(3))
def test_kl_estimators_match_numpy(seed):
    prox, behav, mask, (prox_d, behav_d) = _random_tokens(seed)
    lp, lb = prox.numpy()[mask.numpy()], behav.numpy()[mask.numpy()]
    rho = np.exp(lp - lb)
    assert M.kl_divergence(behav_d, prox_d, mask, estimator="k1") == pytest.approx(np.mean(lb - lp), rel=1e-12)
    assert M.kl_divergence(behav_d, prox_d, mask, estimator="k3") == pytest.approx(
        np.mean((rho - 1) - np.log(rho)), rel=1e-12
    )


def test_kl_estimators_are_unbiased_for_the_true_kl():
    # Sample tokens from a categorical π_behav; both estimators must average to KL(π_behav‖π_prox).
    p = np.array([0.7, 0.2, 0.1])
    q = np.array([0.3, 0.3, 0.4])
    tokens = torch.multinomial(torch.tensor(p), 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    behav = torch.tensor(np.log(p))[tokens][None]
    prox = torch.tensor(np.log(q))[tokens][None]
    mask = torch.ones_like(behav, dtype=torch.bool)
    exact = scipy.stats.entropy(p, q)  # ≈ 0.373; the standard errors of both estimates are below 2e-3
    for estimator in M.KL_ESTIMATORS:
        assert M.kl_divergence(behav, prox, mask, estimator=estimator) == pytest.approx(exact, abs=8e-3)
    # the tolerance separates the two directions: KL(π_prox‖π_behav) ≈ 0.422
    assert abs(scipy.stats.entropy(q, p) - exact) > 0.04


def test_kl_per_token_k3_is_nonnegative_and_zero_only_at_equality():
    a = torch.linspace(-5, 0, 11, dtype=torch.float64)
    b = a.flip(0)
    k3 = M.kl_per_token(a, b, "k3")
    assert k3[5] == 0 and a[5] == b[5]  # the middle pair is equal
    assert (k3[a != b] > 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        M.kl_per_token(a, b, "k2")


@pytest.mark.parametrize("seed", range(3))
def test_pearson_matches_scipy(seed):
    train, rollout, mask, (train_d, rollout_d) = _random_tokens(seed)
    m = mask.numpy()
    want = scipy.stats.pearsonr(np.exp(train.numpy()[m]), np.exp(rollout.numpy()[m])).statistic
    assert M.prob_pearson(train_d, rollout_d, mask) == pytest.approx(want, rel=1e-10)


def test_pearson_is_nan_when_undefined():
    mask = torch.tensor([[True, True, False]])
    const = torch.tensor([[-1.0, -1.0, -3.0]])
    varied = torch.tensor([[-1.0, -2.0, -3.0]])
    assert math.isnan(M.prob_pearson(const, varied, mask))
    assert math.isnan(M.prob_pearson(varied, varied, torch.tensor([[True, False, False]])))
    assert M.prob_pearson(varied, varied, torch.ones(1, 3, dtype=torch.bool)) == pytest.approx(1.0)


def test_mean_abs_logprob_diff_matches_numpy():
    train, rollout, mask, (train_d, rollout_d) = _random_tokens(5)
    m = mask.numpy()
    want = np.mean(np.abs(train.numpy()[m] - rollout.numpy()[m]))
    assert M.mean_abs_logprob_diff(train_d, rollout_d, mask) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("cap", [1.2, 2.0, math.inf])
def test_importance_ratio_stats_match_numpy(cap):
    prox, behav, mask, (prox_d, behav_d) = _random_tokens(7, spread=0.4)
    m = mask.numpy()
    r = np.exp(prox.numpy()[m] - behav.numpy()[m])
    got = M.importance_ratio_stats(prox_d, behav_d, mask, cap=cap)
    assert got["mean"] == pytest.approx(r.mean(), rel=1e-12)
    assert got["max"] == pytest.approx(r.max(), rel=1e-12)
    assert got["truncated_frac"] == pytest.approx(np.mean(r > cap))
    assert got["masked_frac"] == pytest.approx(np.mean((r > cap) | (r < 1 / cap)))
    if cap == 1.2:
        assert 0 < got["truncated_frac"] < got["masked_frac"] < 1  # the data exercise both counts


def test_importance_ratio_stats_reject_a_cap_below_one():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        M.importance_ratio_stats(x, x, torch.ones(1, 2), cap=0.5)


def test_clip_fractions_by_hand():
    ratio = torch.tensor([[0.7, 0.7, 1.3, 1.3, 1.0, 0.5]])
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # the last token would count as low-clipped
    # low: A < 0 and ratio < 0.8 → token 0; high: A > 0 and ratio > 1.2 → token 2; 5 tokens in all.
    assert M.clip_fractions(ratio, adv, 0.8, 1.2, mask) == (0.2, 0.2)
    # per-token bounds: with an upper bound of 1.5 on token 2 nothing is high-clipped
    upper = torch.tensor([[1.2, 1.2, 1.5, 1.2, 1.2, 1.2]])
    assert M.clip_fractions(ratio, adv, 0.8, upper, mask) == (0.2, 0.0)


def test_masked_mean_ignores_nan_padding_and_passes_gradient():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = M.masked_mean(x, mask)
    out.backward()
    assert out.item() == pytest.approx(13 / 4)
    assert x.grad.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]]


@pytest.mark.parametrize(
    "call",
    [
        lambda x, m: M.masked_mean(x, m),
        lambda x, m: M.kl_divergence(x, x, m),
        lambda x, m: M.prob_pearson(x, x, m),
        lambda x, m: M.mean_abs_logprob_diff(x, x, m),
    ],
)
def test_empty_mask_raises(call):
    with pytest.raises(ValueError, match="mask selects no tokens"):
        call(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="shapes"):
        M.mean_abs_logprob_diff(torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        M.prob_pearson(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))


# --- MoE routing agreement --------------------------------------------------------------------------------------


@st.composite
def routings(draw):
    """Top-k expert indices for train and rollout: rollout swaps some experts and shuffles the order within k."""
    tokens, layers, k, experts = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), 8
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    train = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)])
    rollout = train.copy()
    for t in range(tokens):
        for layer in range(layers):
            for j in range(draw(st.integers(0, k))):  # replace j experts by ones not yet chosen
                unused = np.setdiff1d(np.arange(experts), rollout[t, layer])
                rollout[t, layer, j] = rng.choice(unused)
            rng.shuffle(rollout[t, layer])
    mask = np.array(draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens)))
    mask[draw(st.integers(0, tokens - 1))] = True
    return train, rollout, mask


@settings(max_examples=80, deadline=None)
@given(data=routings(), use_mask=st.booleans())
def test_topk_agreement_matches_numpy_set_ops(data, use_mask):
    train, rollout, mask = data
    keep = mask if use_mask else np.ones(len(train), dtype=bool)
    tokens, layers, k = train[keep].shape
    match = np.array([[set(a) == set(b) for a, b in zip(ta, ra)] for ta, ra in zip(train[keep], rollout[keep])])
    overlap = np.array(
        [[len(np.intersect1d(a, b)) / k for a, b in zip(ta, ra)] for ta, ra in zip(train[keep], rollout[keep])]
    )
    torch_mask = torch.tensor(mask) if use_mask else None
    per_layer, overall = M.topk_match_fraction(torch.tensor(train), torch.tensor(rollout), torch_mask)
    np.testing.assert_allclose(per_layer.numpy(), match.mean(axis=0), rtol=1e-12)
    assert overall == pytest.approx(match.mean(), rel=1e-12)
    assert per_layer.shape == (layers,) and type(overall) is float
    per_layer, overall = M.topk_overlap_mean(torch.tensor(train), torch.tensor(rollout), torch_mask)
    np.testing.assert_allclose(per_layer.numpy(), overlap.mean(axis=0), rtol=1e-12)
    assert overall == pytest.approx(overlap.mean(), rel=1e-12)


def test_topk_by_hand():
    # token 0: layer 0 same set in another order, layer 1 shares one of two experts;
    # token 1: layer 0 disjoint, layer 1 identical.
    train = torch.tensor([[[1, 2], [3, 4]], [[0, 1], [5, 6]]])
    rollout = torch.tensor([[[2, 1], [4, 7]], [[2, 3], [5, 6]]])
    per_layer, overall = M.topk_match_fraction(train, rollout)
    assert per_layer.tolist() == [0.5, 0.5] and overall == 0.5
    per_layer, overall = M.topk_overlap_mean(train, rollout)
    assert per_layer.tolist() == [0.5, 0.75] and overall == 0.625
    per_layer, overall = M.topk_overlap_mean(train, rollout, torch.tensor([False, True]))
    assert per_layer.tolist() == [0.0, 1.0] and overall == 0.5


def test_topk_bad_inputs():
    idx = torch.zeros(3, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[tokens, layers, k\]"):
        M.topk_match_fraction(idx, idx[:, :1])
    with pytest.raises(ValueError, match=r"\[tokens, layers, k\]"):
        M.topk_overlap_mean(idx[:, 0], idx[:, 0])
    with pytest.raises(ValueError, match="mask has shape"):
        M.topk_match_fraction(idx, idx, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens"):
        M.topk_match_fraction(idx, idx, torch.zeros(3, dtype=torch.bool))
