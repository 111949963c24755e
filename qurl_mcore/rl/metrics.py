"""Diagnostics of the train/rollout mismatch in quantized-rollout RL.

Per-token inputs are shaped like the log-prob tensors ([batch, seq] or any shape) and come with a mask of the
tokens to count; values outside the mask never reach a result, so padding may hold anything, NaN included.
Scalar metrics are returned as Python floats, ready to log, or (`on_device`) as device tensors to read later.

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


def _checked(mask: Tensor, *values: Tensor, on_device: bool = False) -> tuple[Tensor, ...]:
    """The bool mask and each (same-shaped) tensor, detached, after checking shapes and (unless `on_device`:
    that check reads the mask back to the host) that the mask selects a token."""
    shape = values[0].shape
    for v in values[1:]:
        if v.shape != shape:
            raise ValueError(f"per-token tensors have shapes {tuple(shape)} and {tuple(v.shape)}; they must match")
    mask = as_bool_mask(mask, shape)
    if not on_device:
        _require_tokens(mask)
    return (mask, *(v.detach() for v in values))


def _read(value: Tensor, on_device: bool) -> Tensor | float:
    """`value` as it is (a 0-dim tensor on its device) or read back to the host as a Python float."""
    return value if on_device else value.item()


def masked_mean(values: Tensor, mask: Tensor, *, on_device: bool = False) -> Tensor:
    """Σ mask·values / Σ mask, differentiable; padding is replaced before the sum, so NaN there cannot leak.
    `on_device`: skip the check that the mask selects a token (it reads back to the host); 0/0 is then NaN."""
    mask = as_bool_mask(mask, values.shape)
    if not on_device:
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


# Every scalar metric below is a Python float, or with `on_device` a 0-dim float64 tensor on the inputs' device
# computed without reading anything back to the host (a trainer reads them once per step, not per micro-batch);
# the mask is then not checked for tokens (0/0 gives NaN).


def kl_divergence(sample_logprobs: Tensor, other_logprobs: Tensor, mask: Tensor, *, estimator: str = "k3",
                  on_device: bool = False) -> float | Tensor:
    """Mean over masked tokens of `kl_per_token`: KL(p‖q) with the tokens drawn from p.

    For the rollout mismatch pass p = π_behav (it sampled the tokens) and q = π_prox.
    """
    mask, p, q = _checked(mask, sample_logprobs, other_logprobs, on_device=on_device)
    return _read(masked_mean(kl_per_token(p.double(), q.double(), estimator), mask, on_device=True), on_device)


def mean_abs_logprob_diff(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                          on_device: bool = False) -> float | Tensor:
    """mean |log π_train − log π_rollout| over masked tokens."""
    mask, a, b = _checked(mask, train_logprobs, rollout_logprobs, on_device=on_device)
    return _read(masked_mean((a.double() - b.double()).abs(), mask, on_device=True), on_device)


def prob_pearson(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                 on_device: bool = False) -> float | Tensor:
    """Pearson correlation of the token probabilities π_train and π_rollout over masked tokens (MoEResQ's PCC).

    NaN when it is undefined: fewer than two tokens, or either side constant.
    """
    mask, a, b = _checked(mask, train_logprobs, rollout_logprobs, on_device=on_device)
    x, y = (torch.where(mask, v.double().exp(), 0) for v in (a, b))
    x = torch.where(mask, x - masked_mean(x, mask, on_device=True), 0)
    y = torch.where(mask, y - masked_mean(y, mask, on_device=True), 0)
    # A single token or a constant side makes this 0/0, i.e. NaN, like scipy.stats.pearsonr.
    return _read((x.flatten() @ y.flatten() / (x.norm() * y.norm())).clamp(-1.0, 1.0), on_device)


def importance_ratio_stats(
    prox_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, *, cap: float, on_device: bool = False
) -> dict[str, float | Tensor]:
    """Statistics of r = π_prox/π_behav over masked tokens.

    Keys: ``mean``, ``max``, ``truncated_frac`` (share with r > cap, what TIS/ACR truncate) and ``masked_frac``
    (share with r outside [1/cap, cap], what MIS drops).
    """
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1 (got {cap}); [1/cap, cap] must contain r = 1")
    mask, p, b = _checked(mask, prox_logprobs, behav_logprobs, on_device=on_device)
    log_r = p.double() - b.double()
    r = log_r.exp()
    log_cap = math.log(cap)
    stats = {
        "mean": masked_mean(r, mask, on_device=True),
        "max": torch.where(mask, r, -math.inf).max(),
        "truncated_frac": masked_mean((log_r > log_cap).double(), mask, on_device=True),
        "masked_frac": masked_mean((log_r.abs() > log_cap).double(), mask, on_device=True),
    }
    return {k: _read(v, on_device) for k, v in stats.items()}


def clip_fractions(
    ratio: Tensor, advantages: Tensor, lower: Tensor | float, upper: Tensor | float, mask: Tensor, *,
    on_device: bool = False
) -> tuple[float | Tensor, float | Tensor]:
    """Shares of masked tokens whose gradient the clip removes: (low, high).

    In min(ratio·A, clip(ratio, lower, upper)·A) the clipped branch wins, and is flat, exactly when
    A < 0 and ratio < lower (low) or A > 0 and ratio > upper (high). `advantages` is per token, like `ratio`;
    `lower`/`upper` are numbers or per-token tensors.
    """
    if advantages.shape != ratio.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, ratio {tuple(ratio.shape)}; they must match")
    low = (advantages < 0) & (ratio < lower)
    high = (advantages > 0) & (ratio > upper)
    mask, low, high = _checked(mask, low, high, on_device=on_device)
    low, high = (masked_mean(v.double(), mask, on_device=True) for v in (low, high))
    return _read(low, on_device), _read(high, on_device)


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


def topk_agreement_sums(train_idx: Tensor, rollout_idx: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per layer, over the tokens given ([tokens, layers, k] each) that `mask` ([tokens], default all) selects:
    (Σ_t [E_t = F_t], Σ_t |E_t ∩ F_t| / k), float64 [layers] each; sums, so that batches and ranks add up before
    dividing by the token count. Nothing is read back to the host."""
    train_idx, rollout_idx = _topk_per_token(train_idx, rollout_idx, None)
    counts = _overlap_counts(train_idx, rollout_idx)
    weight = torch.ones(counts.shape[0], 1, dtype=torch.float64, device=counts.device) if mask is None else (
        as_bool_mask(mask, counts.shape[:1]).double()[:, None])
    k = train_idx.shape[-1]
    return ((counts == k).double() * weight).sum(dim=0), (counts.double() * weight).sum(dim=0) / k


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
