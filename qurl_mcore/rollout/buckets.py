"""Split a weight push into buckets of bounded size (peak extra memory of one push = one bucket)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(named_tensors: Iterable[NamedTensor], max_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups of at most `max_bytes` each, in the given order; a tensor larger than the bound
    travels alone (tensors are never split: SGLang's loaders take whole checkpoint tensors)."""
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        n = nbytes(tensor)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
