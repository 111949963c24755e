"""Routed slots sorted and block-aligned by expert (qurl_mcore/kernels/align.py), against a per-expert count
done by hand."""
from __future__ import annotations

import math

import pytest
import torch

from qurl_mcore.kernels.align import align, capacity


@pytest.mark.parametrize("tokens, k, experts, block_m", [(5, 2, 8, 16), (1, 1, 4, 16), (40, 8, 16, 16),
                                                         (7, 3, 3, 4)])
def test_every_routed_slot_is_in_one_block_of_its_expert_and_no_other_slot_is(tokens, k, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-2, experts + 2, (tokens, k), generator=g)  # outside [0, E): another rank's, padding
    ids[ids == 1] = 0  # expert 1: empty
    r = align(ids, experts, block_m)
    flat = ids.reshape(-1)
    sizes = {e: int((flat == e).sum()) for e in range(experts)}
    used = int(r.padded)
    assert used == sum(math.ceil(n / block_m) * block_m for n in sizes.values())
    assert r.sorted_ids.numel() == capacity(tokens * k, experts, block_m) >= used
    listed = r.sorted_ids[:used]
    real = listed[listed < tokens * k].long()
    routed = torch.where((flat >= 0) & (flat < experts))[0]
    assert sorted(real.tolist()) == routed.tolist()  # each routed slot once, no other
    assert (r.sorted_ids[used:] == tokens * k).all()
    blocks = r.block_expert[: used // block_m].long()
    assert blocks.tolist() == sorted(blocks.tolist()) and 1 not in blocks.tolist()
    for b, e in enumerate(blocks.tolist()):  # a block holds its expert's slots (and padding) only
        slots = r.sorted_ids[b * block_m:(b + 1) * block_m]
        assert (flat[slots[slots < tokens * k].long()] == e).all()
    assert (r.block_expert[used // block_m:] == experts).all()  # blocks past the routing: none


def test_capacity_is_the_worst_routing():
    """Every expert one slot: each pads a whole block; the capacity holds it, rounded to blocks."""
    ids = torch.arange(8).reshape(8, 1)
    r = align(ids, 8, 16)
    assert int(r.padded) == 8 * 16 == capacity(8, 8, 16) == r.sorted_ids.numel()
