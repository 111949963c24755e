"""Clipped policy-gradient losses for RL whose rollouts come from another (e.g. quantized) policy.

Per response token: π_θ is the policy being trained (gradients flow through its log-probs), π_prox the proximal
policy (the full-precision old actor, re-scored by the trainer), π_behav the behaviour policy that sampled the
token (the quantized rollout actor). R = π_θ/π_prox, r = π_prox/π_behav (a constant), A the advantage.
The formulas, when to use which, and the logged metric names are in docs/objectives.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qurl_mcore.rl import AGGREGATIONS, LOSSES
from qurl_mcore.rl import metrics as M


def aggregate(values: Tensor, mask: Tensor, agg: str = "token_mean", *, on_device: bool = False) -> Tensor:
    """Reduce per-token `values` [batch, seq] to a scalar over the response tokens in `mask`.

    - ``token_mean``: Σ_{i,t} m·v / Σ_{i,t} m (DAPO; every token weighs the same).
    - ``seq_mean_token_mean``: mean, over sequences with ≥ 1 response token, of Σ_t m·v / Σ_t m (GRPO).
    - ``seq_mean_token_sum``: mean over all sequences of Σ_t m·v (no length normalisation).
    `on_device`: skip the check that the mask selects a token (it reads back to the host); 0/0 is then NaN.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGREGATIONS}")
    if agg == "token_mean":
        return M.masked_mean(values, mask, on_device=on_device)
    if values.dim() != 2:
        raise ValueError(f"{agg} needs per-token values shaped [batch, seq]; got {tuple(values.shape)}")
    mask = M.as_bool_mask(mask, values.shape)
    sums = torch.where(mask, values, 0).sum(dim=-1)
    if agg == "seq_mean_token_sum":
        return sums.mean()
    counts = mask.sum(dim=-1)
    nonempty = counts > 0
    if not on_device and not nonempty.any():
        raise ValueError("mask selects no tokens; drop empty micro-batches before calling")
    # an empty sequence adds 0/1 to the sum and nothing to the count
    return (sums / counts.clamp(min=1)).sum() / nonempty.sum()


def aggregation_units(mask: Tensor, agg: str) -> Tensor:
    """What `aggregate(·, mask, agg)` divides by: response tokens, non-empty sequences, or sequences, as a 0-dim
    int64 tensor on mask's device (nothing read back to the host). A loss times its units is a sum, so
    micro-batches add up to the loss of their whole batch."""
    if agg == "token_mean":
        return mask.sum()
    if agg == "seq_mean_token_mean":
        return (mask.sum(dim=-1) > 0).sum()
    return mask.new_full((), mask.shape[0], dtype=torch.int64)  # a fill, not a host-to-device copy


def policy_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    method: str,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    tis_cap: float = 2.0,
    agg: str = "token_mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    on_device: bool = False,
) -> tuple[Tensor, dict[str, float | Tensor]]:
    """Negative clipped policy objective (to minimise) plus optional KL and entropy terms, and its metrics.

    Log-probs, `mask` (response tokens), and the optional `ref_logprobs`/`entropy` are [batch, seq];
    `advantages` is [batch] (one per sequence) or [batch, seq]. Only `logprobs` (and `entropy`) carry gradient.
    With clip(x) = clip(x, 1 − eps_low, 1 + eps_high) and C = tis_cap, the per-token objective is

    - ``ppo``:       min(R·A, clip(R)·A); π_behav is ignored (QuRL Eq. 1); eps_low ≠ eps_high is DAPO's
      clip-higher.
    - ``naive``:     min(ρ·A, clip(ρ)·A) with ρ = π_θ/π_behav (QuRL Eq. 3).
    - ``decoupled``: r · min(R·A, clip(R)·A) (decoupled PPO, AReaL).
    - ``tis``:       min(r, C) · min(R·A, clip(R)·A) (FlashRL's truncated importance sampling).
    - ``mis``:       as ``decoupled`` but with weight 0 where r ∉ [1/C, C] (IcePop's masked IS); those tokens
      still count in the normaliser.
    - ``acr``:       min(r, C) · min(R·A, clip(R, 1 − eps_low, u)·A), u = max(1 − eps_low, (1 + eps_high)/r)
      (QuRL's adaptive clipping range).
    - ``acr_symmetric``: as ``acr`` with the lower bound adapted too: clip(R, (1 − eps_low)/r, (1 + eps_high)/r),
      i.e. the range applied to the product: r·clip(R, ·) = clip(rR, 1 − eps_low, 1 + eps_high) for r ≤ C.
    - ``acr_trunc``: the clipped objective on the ratio to QuRL's truncated behaviour policy
      π_behav^trunc = max(π_behav, π_prox/C): with r̃ = min(r, C), r̃ · min(R·A, clip(R, (1 − eps_low)/r̃,
      (1 + eps_high)/r̃)·A) = min(ρ̃·A, clip(ρ̃)·A), ρ̃ = r̃R. As ``acr_symmetric`` while r ≤ C.

    ACR derivation (QuRL §4.2). Since r > 0, r·min(x, y) = min(r·x, r·y) and
    r·clip(R, 1 − ε, 1 + ε) = clip(r·R, r(1 − ε), r(1 + ε)), so the decoupled objective is a clipped objective
    on ρ = r·R, the ratio to the policy that actually sampled the token, with the trust region
    [r(1 − ε), r(1 + ε)]: it drifts with the rollout mismatch, and where the quantized actor under-rates a token
    (r > 1) an update may push its probability to r(1 + ε) times the rollout's. ACR pins the upper end:
    ρ ≤ 1 + eps_high ⇔ R ≤ (1 + eps_high)/r. The max with 1 − eps_low keeps the range non-empty when
    r > (1 + eps_high)/(1 − eps_low); there the cap on ρ becomes r(1 − eps_low). Hence, for A > 0, a token's
    gradient vanishes once ρ > max(1 + eps_high, r(1 − eps_low)). The paper states the identity but not the
    final formula; the form above comes from secondary descriptions of the paper, which is why the symmetric
    reading is offered as ``acr_symmetric``. Note that for r ≤ C that reading is exactly ``naive`` (pin both
    ends of the range on ρ to [1 − eps_low, 1 + eps_high]), and (C/r)·``naive`` beyond, i.e. the objective
    QuRL §4.1 reports as unstable; prefer ``acr``.

    The per-token objective J is reduced with `aggregate(·, mask, agg)`, and the returned loss is
    −agg(J) + kl_coef·agg(KL_t) − entropy_coef·agg(entropy), where KL_t is `kl_estimator` ("k1" or "k3")
    of KL(π_θ‖π_ref) per token (see `metrics.kl_per_token`).

    Metrics (Python floats; names as logged, described in docs/objectives.md): ``loss/total``, ``loss/policy``,
    ``clip_frac/low``, ``clip_frac/high``, ``is_ratio/{mean,max,truncated_frac,masked_frac}``,
    ``mismatch/{kl_k1,kl_k3,abs_logprob_diff,prob_pearson}``, plus ``kl_ref`` when `ref_logprobs` is given
    and ``entropy`` when `entropy` is given. `on_device`: nothing is read back to the host (a trainer's
    micro-batch): the metrics are detached 0-dim tensors on the inputs' device, and the inputs are not checked
    for an empty mask or non-finite response-token values (the caller checks; they give NaN here).
    """
    _check_options(method, eps_low, eps_high, tis_cap, agg, kl_estimator, ref_logprobs, kl_coef, entropy, entropy_coef)
    mask, t = _prepare_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, mask, ref_logprobs, entropy,
                              check_values=not on_device)
    obj, ratio, lower, upper = _surrogate(
        t["logprobs"], t["prox_logprobs"], t["behav_logprobs"], t["advantages"], method, eps_low, eps_high, tis_cap
    )
    read = (lambda v: v.detach()) if on_device else (lambda v: v.item())  # noqa: E731
    policy = -aggregate(obj, mask, agg, on_device=on_device)
    loss = policy
    low, high = M.clip_fractions(ratio, t["advantages"], lower, upper, mask, on_device=on_device)
    prox, behav = t["prox_logprobs"], t["behav_logprobs"]
    ratios = M.importance_ratio_stats(prox, behav, mask, cap=tis_cap, on_device=on_device)
    metrics = {
        "loss/policy": read(policy),
        "clip_frac/low": low,
        "clip_frac/high": high,
        **{f"is_ratio/{k}": v for k, v in ratios.items()},
        **{f"mismatch/kl_{e}": M.kl_divergence(behav, prox, mask, estimator=e, on_device=on_device)
           for e in M.KL_ESTIMATORS},
        "mismatch/abs_logprob_diff": M.mean_abs_logprob_diff(prox, behav, mask, on_device=on_device),
        "mismatch/prob_pearson": M.prob_pearson(prox, behav, mask, on_device=on_device),
    }
    if ref_logprobs is not None:
        kl = aggregate(M.kl_per_token(t["logprobs"], t["ref_logprobs"], kl_estimator), mask, agg, on_device=on_device)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = read(kl)
    if entropy is not None:
        ent = aggregate(t["entropy"], mask, agg, on_device=on_device)
        loss = loss - entropy_coef * ent
        metrics["entropy"] = read(ent)
    metrics["loss/total"] = read(loss)
    return loss, metrics


def _surrogate(
    logprobs: Tensor,
    prox: Tensor,
    behav: Tensor,
    adv: Tensor,
    method: str,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
) -> tuple[Tensor, Tensor, Tensor | float, Tensor | float]:
    """Per-token objective, and the ratio and bounds it clipped (the clip fractions are measured on them)."""
    lower: Tensor | float = 1.0 - eps_low
    upper: Tensor | float = 1.0 + eps_high
    weight: Tensor | float = 1.0
    if method == "naive":
        ratio = torch.exp(logprobs - behav)
    else:
        ratio = torch.exp(logprobs - prox)
        log_r = prox - behav
        r = torch.exp(log_r)
        if method == "decoupled":
            weight = r
        elif method == "mis":
            # Compared in log space so that the test agrees with metrics.importance_ratio_stats' masked_frac.
            weight = torch.where(log_r.abs() <= math.log(tis_cap), r, 0)
        elif method != "ppo":  # tis, acr, acr_symmetric, acr_trunc
            weight = r.clamp(max=tis_cap)
            if method == "acr":
                upper = (upper / r).clamp(min=lower)
            elif method == "acr_symmetric":
                lower, upper = lower / r, upper / r
            elif method == "acr_trunc":
                lower, upper = lower / weight, upper / weight
    clipped = ratio.clamp(min=lower).clamp(max=upper)
    return weight * torch.minimum(ratio * adv, clipped * adv), ratio, lower, upper


def _check_options(
    method: str,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
    agg: str,
    kl_estimator: str,
    ref_logprobs: Tensor | None,
    kl_coef: float,
    entropy: Tensor | None,
    entropy_coef: float,
) -> None:
    if method not in LOSSES:
        raise ValueError(f"unknown method {method!r}; use one of {LOSSES}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; use one of {AGGREGATIONS}")
    if kl_estimator not in M.KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; use one of {M.KL_ESTIMATORS}")
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1) so that the lower clip bound 1 - eps_low > 0; got {eps_low}")
    if not 0 <= eps_high < math.inf:
        raise ValueError(f"eps_high must be finite and >= 0; got {eps_high}")
    if not tis_cap >= 1:
        raise ValueError(f"tis_cap must be >= 1 so that r = 1 is never cut (math.inf: no cap); got {tis_cap}")
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError("kl_coef is non-zero but ref_logprobs is None; pass the reference log-probs or set kl_coef=0")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef is non-zero but entropy is None; pass per-token entropy or set entropy_coef=0")


def _prepare_inputs(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    check_values: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Check shapes, and with `check_values` (reading back to the host) that the mask selects a token and the
    response tokens are finite; return the bool mask and the inputs in a common float dtype with padding
    zeroed (so that garbage there, NaN included, reaches neither the loss nor the gradient)."""
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a float tensor [batch, seq]; got {logprobs.dtype} {tuple(logprobs.shape)}")
    shape = logprobs.shape
    mask = M.as_bool_mask(mask, shape)
    if check_values and not mask.any():
        raise ValueError("mask selects no response tokens; drop empty micro-batches before calling")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1).expand(shape)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; pass [batch]={tuple(shape[:1])} per sequence "
            f"or [batch, seq]={tuple(shape)} per token"
        )
    # bf16/fp16 log-probs lose too much in exp(Δ): compute in at least float32.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    named = {
        "logprobs": logprobs,
        "prox_logprobs": prox_logprobs.detach(),
        "behav_logprobs": behav_logprobs.detach(),
        "advantages": advantages.detach(),
        "ref_logprobs": None if ref_logprobs is None else ref_logprobs.detach(),
        "entropy": entropy,
    }
    out = {}
    for name, x in named.items():
        if x is None:
            continue
        if x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but logprobs has {tuple(shape)}; they must match")
        bad = mask & ~torch.isfinite(x) if check_values else None
        if bad is not None and bad.any():
            first = bad.nonzero()[0].tolist()
            raise ValueError(
                f"{name} has {int(bad.sum())} non-finite value(s) at response tokens (first at {first}); "
                "fix them at the source or set mask to 0 there"
            )
        out[name] = torch.where(mask, x.to(dtype), 0)
    return mask, out
