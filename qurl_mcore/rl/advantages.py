"""Critic-free advantages for group sampling (n responses per prompt) and DAPO's dynamic-sampling filter.

Every function takes rewards as [num_groups, n], or flat [num_groups * n] (group after group) with `group_size=n`,
and returns advantages in the shape it was given.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _as_groups(rewards: Tensor, group_size: int | None) -> Tensor:
    """Rewards as a float [num_groups, n] view, after checking the layout and that they are finite."""
    if group_size is None:
        if rewards.dim() != 2:
            raise ValueError(
                f"rewards has shape {tuple(rewards.shape)}; "
                "pass [num_groups, n], or flat [num_groups * n] with group_size=n"
            )
        groups = rewards
    else:
        if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
            raise ValueError(
                f"flat rewards need a 1-D tensor whose length is a multiple of group_size; "
                f"got shape {tuple(rewards.shape)} with group_size={group_size}"
            )
        groups = rewards.reshape(-1, group_size)
    if groups.shape[1] < 2:
        raise ValueError(f"groups have {groups.shape[1]} response(s); a baseline needs at least 2 responses per prompt")
    if not torch.isfinite(groups).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function's output")
    return groups.to(torch.promote_types(groups.dtype, torch.float32))


def grpo_advantages(
    rewards: Tensor, group_size: int | None = None, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: A_i = (r_i − mean_g) / (std_g + eps), std with Bessel's correction (n − 1), as in GRPO implementations.

    `scale_by_std=False` gives Dr. GRPO's A_i = r_i − mean_g, which does not up-weight groups with small
    reward spread. Groups whose rewards are all equal get A = 0.
    """
    groups = _as_groups(rewards, group_size)
    adv = groups - groups.mean(dim=-1, keepdim=True)
    if scale_by_std:
        adv = adv / (groups.std(dim=-1, keepdim=True) + eps)
    return adv.view(rewards.shape)


def rloo_advantages(rewards: Tensor, group_size: int | None = None) -> Tensor:
    """RLOO: A_i = r_i − mean_{j≠i} r_j, the leave-one-out baseline; equal to n/(n − 1)·(r_i − mean_g)."""
    groups = _as_groups(rewards, group_size)
    n = groups.shape[-1]
    loo_baseline = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
    return (groups - loo_baseline).view(rewards.shape)


def dynamic_sampling_mask(rewards: Tensor, group_size: int | None = None) -> Tensor:
    """DAPO's dynamic-sampling filter: bool [num_groups], False for groups whose rewards are all equal.

    Such groups have zero group-relative advantage and only dilute the batch. Group indices to keep:
    ``mask.nonzero().squeeze(-1)``; per-response mask for flat rewards: ``mask.repeat_interleave(n)``.
    """
    groups = _as_groups(rewards, group_size)
    return groups.amax(dim=-1) > groups.amin(dim=-1)
