"""Diagnostics of the train/rollout mismatch in quantized-rollout RL.

Per-token inputs are shaped like the log-prob tensors ([batch, seq] or any shape) and come with a mask of the
tokens to count; values outside the mask are never read, so padding may hold anything, NaN included.
Scalar metrics are returned as Python floats, ready to log.

Notation: π_train is the policy the trainer scores tokens with (the full-precision proximal policy π_prox),
π_rollout the policy that sampled them (the quantized behaviour policy π_behav).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qurl_mcore.rl import KL_ESTIMATORS


def as_bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    """`mask` as a bool tensor, after checking that it has `shape` and holds only 0/1."""
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the values have {tuple(shape)}; give one per token")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be boolean or hold only 0/1; convert it with `mask > 0` if that is what you mean")
    return mask.bool()


def _require_tokens(mask: Tensor) -> None:
    # Every metric and loss here is a mean over the selected tokens, which would silently be 0/0.
    if not mask.any():
        raise ValueError("mask selects no tokens; drop empty micro-batches before calling")


def _selected(mask: Tensor, *values: Tensor) -> tuple[Tensor, ...]:
    """The masked entries of each (same-shaped) tensor, detached and flattened."""
    shape = values[0].shape
    for v in values[1:]:
        if v.shape != shape:
            raise ValueError(f"per-token tensors have shapes {tuple(shape)} and {tuple(v.shape)}; they must match")
    mask = as_bool_mask(mask, shape)
    _require_tokens(mask)
    return tuple(v.detach()[mask] for v in values)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ mask·values / Σ mask, differentiable; padding is replaced before the sum, so NaN there cannot leak."""
    mask = as_bool_mask(mask, values.shape)
    _require_tokens(mask)
    return torch.where(mask, values, 0).sum() / mask.sum()


def kl_per_token(sample_logprobs: Tensor, other_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token Monte-Carlo estimate of KL(p‖q) for tokens drawn from p (Schulman's k1 / k3).

    With ρ = q/p at the sampled token: k1 = log p − log q = −log ρ, and k3 = (ρ − 1) − log ρ, which has the
    same expectation under p (E_p[ρ] = 1) but is never negative and has lower variance when p ≈ q.
    """
    log_rho = other_logprobs - sample_logprobs
    if estimator == "k1":
        return -log_rho
    if estimator == "k3":
        return torch.expm1(log_rho) - log_rho
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def kl_divergence(sample_logprobs: Tensor, other_logprobs: Tensor, mask: Tensor, *, estimator: str = "k3") -> float:
    """Mean over masked tokens of `kl_per_token`: KL(p‖q) with the tokens drawn from p.

    For the rollout mismatch pass p = π_behav (it sampled the tokens) and q = π_prox.
    """
    p, q = _selected(mask, sample_logprobs, other_logprobs)
    return kl_per_token(p.double(), q.double(), estimator).mean().item()


def mean_abs_logprob_diff(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> float:
    """mean |log π_train − log π_rollout| over masked tokens."""
    a, b = _selected(mask, train_logprobs, rollout_logprobs)
    return (a.double() - b.double()).abs().mean().item()


def prob_pearson(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> float:
    """Pearson correlation of the token probabilities π_train and π_rollout over masked tokens (MoEResQ's PCC).

    NaN when it is undefined: fewer than two tokens, or either side constant.
    """
    a, b = _selected(mask, train_logprobs, rollout_logprobs)
    x = a.double().exp()
    y = b.double().exp()
    x = x - x.mean()
    y = y - y.mean()
    # A single token or a constant side makes this 0/0, i.e. NaN, like scipy.stats.pearsonr.
    return (x @ y / (x.norm() * y.norm())).clamp(-1.0, 1.0).item()


def importance_ratio_stats(
    prox_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, *, cap: float
) -> dict[str, float]:
    """Statistics of r = π_prox/π_behav over masked tokens.

    Keys: ``mean``, ``max``, ``truncated_frac`` (share with r > cap, what TIS/ACR truncate) and ``masked_frac``
    (share with r outside [1/cap, cap], what MIS drops).
    """
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1 (got {cap}); [1/cap, cap] must contain r = 1")
    p, b = _selected(mask, prox_logprobs, behav_logprobs)
    log_r = p.double() - b.double()
    r = log_r.exp()
    log_cap = math.log(cap)
    return {
        "mean": r.mean().item(),
        "max": r.max().item(),
        "truncated_frac": (log_r > log_cap).double().mean().item(),
        "masked_frac": (log_r.abs() > log_cap).double().mean().item(),
    }


def clip_fractions(
    ratio: Tensor, advantages: Tensor, lower: Tensor | float, upper: Tensor | float, mask: Tensor
) -> tuple[float, float]:
    """Shares of masked tokens whose gradient the clip removes: (low, high).

    In min(ratio·A, clip(ratio, lower, upper)·A) the clipped branch wins, and is flat, exactly when
    A < 0 and ratio < lower (low) or A > 0 and ratio > upper (high). `advantages` is per token, like `ratio`;
    `lower`/`upper` are numbers or per-token tensors.
    """
    if advantages.shape != ratio.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, ratio {tuple(ratio.shape)}; they must match")
    low = (advantages < 0) & (ratio < lower)
    high = (advantages > 0) & (ratio > upper)
    low, high = _selected(mask, low, high)
    return low.double().mean().item(), high.double().mean().item()


def _topk_per_token(train_idx: Tensor, rollout_idx: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Validate [tokens, layers, k] index tensors; return them restricted to the masked tokens."""
    if train_idx.shape != rollout_idx.shape or train_idx.dim() != 3:
        raise ValueError(
            f"expert indices must both be [tokens, layers, k]; got {tuple(train_idx.shape)} and "
            f"{tuple(rollout_idx.shape)} (add a layers axis of size 1 for a single layer)"
        )
    if mask is not None:
        mask = as_bool_mask(mask, train_idx.shape[:1])
        _require_tokens(mask)
        train_idx, rollout_idx = train_idx[mask], rollout_idx[mask]
    elif train_idx.shape[0] == 0:
        raise ValueError("no tokens to compare; drop empty micro-batches before calling")
    return train_idx, rollout_idx


def _overlap_counts(train_idx: Tensor, rollout_idx: Tensor) -> Tensor:
    """|train set ∩ rollout set| per [token, layer].

    Experts within one top-k are distinct, so after sorting both sets together each shared expert sits twice in
    a row; sorting keeps memory at 2k per entry where an all-pairs comparison would need k².
    """
    both = torch.cat([train_idx, rollout_idx], dim=-1).sort(dim=-1).values
    return (both[..., 1:] == both[..., :-1]).sum(dim=-1)


def topk_agreement_sums(train_idx: Tensor, rollout_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Per layer, over all tokens given ([tokens, layers, k] each): (Σ_t [E_t = F_t], Σ_t |E_t ∩ F_t| / k), float64
    [layers] each; sums, so that batches and ranks add up before dividing by the token count."""
    train_idx, rollout_idx = _topk_per_token(train_idx, rollout_idx, None)
    counts = _overlap_counts(train_idx, rollout_idx)
    k = train_idx.shape[-1]
    return (counts == k).double().sum(dim=0), counts.double().sum(dim=0) / k


def topk_match_fraction(train_idx: Tensor, rollout_idx: Tensor, mask: Tensor | None = None) -> tuple[Tensor, float]:
    """Share of tokens whose top-k expert sets are identical (MoEResQ's top_k_match_frac).

    Indices are [tokens, layers, k]; the order within k is ignored. `mask` ([tokens]) selects the tokens to count.
    Returns (per-layer shares as a float64 tensor [layers], share over all tokens and layers).
    """
    train_idx, rollout_idx = _topk_per_token(train_idx, rollout_idx, mask)
    same = (_overlap_counts(train_idx, rollout_idx) == train_idx.shape[-1]).double()
    return same.mean(dim=0), same.mean().item()


def topk_overlap_mean(train_idx: Tensor, rollout_idx: Tensor, mask: Tensor | None = None) -> tuple[Tensor, float]:
    """Mean of |train set ∩ rollout set| / k (MoEResQ's topk_overlap_mean); same inputs and outputs as
    `topk_match_fraction`."""
    train_idx, rollout_idx = _topk_per_token(train_idx, rollout_idx, mask)
    overlap = _overlap_counts(train_idx, rollout_idx).double() / train_idx.shape[-1]
    return overlap.mean(dim=0), overlap.mean().item()
