"""Routed slots sorted and block-aligned by expert, in torch ops that never read the host (CUDA graphs capture
them), for the fused MoE GEMMs (`fp4_gemm.fp4_moe_gemm`).

A token's j-th routing choice is slot s = token·k + j. The slots of expert e are listed together, padded with
the sentinel `slots` (= T·k) to a multiple of `block_m`, experts in order; `block_expert[b]` is the expert of
block b. Slots routed outside [0, E) (padding, another EP rank's experts) are in no block. The lists have the
largest size any routing can need, Σ_e ⌈n_e/block_m⌉·block_m <= T·k + min(E, T·k)·(block_m − 1), so every shape
is static; `padded` [1] holds the size this routing uses, and the GEMM's programs past it return at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Alignment:
    """`sorted_ids` [capacity] int32 slots (sentinel `slots`), `block_expert` [capacity / block_m] int32,
    `padded` [1] int32: the used length of `sorted_ids`."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    padded: torch.Tensor
    slots: int
    block_m: int

    @property
    def blocks(self) -> int:
        """The grid's first dimension: every block any routing of these slots can fill."""
        return self.block_expert.numel()


def capacity(slots: int, experts: int, block_m: int) -> int:
    """The most slot positions, padding included, that `slots` routed slots over `experts` experts can need."""
    most = slots + min(experts, slots) * (block_m - 1)
    return -(-most // block_m) * block_m


def align(topk_ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """The alignment of `topk_ids` [T, k] (expert ids, any int dtype) over this rank's `experts` experts."""
    slots = topk_ids.numel()
    ids = topk_ids.reshape(-1).to(torch.int64)
    expert = torch.where((ids >= 0) & (ids < experts), ids, experts)  # E: routed elsewhere
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, expert,
                                                                                      torch.ones_like(expert))
    counts = counts[:experts]
    sizes = (counts + block_m - 1) // block_m * block_m
    ends = sizes.cumsum(0)
    order = torch.sort(expert, stable=True).indices  # slots by expert, each expert's in slot order
    by_expert = expert[order]
    local = torch.arange(slots, device=ids.device) - torch.cat([counts.new_zeros(1), counts.cumsum(0)])[by_expert]
    size = capacity(slots, experts, block_m)
    routed = by_expert < experts
    dest = torch.where(routed, (ends - sizes).gather(0, by_expert.clamp(max=experts - 1)) + local, size)
    sorted_ids = torch.full((size + 1,), slots, dtype=torch.int32, device=ids.device)
    sorted_ids = sorted_ids.scatter(0, dest, order.to(torch.int32))[:size]  # position `size`: the unrouted
    starts = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # past the last: E
    return Alignment(sorted_ids, block_expert, ends[-1:].to(torch.int32), slots, block_m)
