"""SGLang's CPU engine, completed through one of SGLang's own registries (no source patch).

Host buffers (for example the routed-experts capture cache behind `return_routed_experts`) are allocated by
`ALLOC_MEMORY_FUNCS[device]`, whose default pins them with cudaHostRegister. A CPU engine has no device to
DMA from pinned memory, and CPU-only torch cannot pin at all, so the "cpu" entry allocates plain memory.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS


def _alloc_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator,
                    registration_granularity_bytes: int | None = None) -> torch.Tensor:
    """SGLang's allocator signature; `pin_memory` is ignored on a CPU engine."""
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def register() -> None:
    """Use unpinned host buffers for engines with device="cpu" (GPU engines never look up this key)."""
    ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_unpinned)
