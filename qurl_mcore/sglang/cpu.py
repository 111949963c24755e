"""SGLang's CPU engine, completed through two of SGLang's own registries (no source patch).

Host buffers (for example the routed-experts capture cache behind `return_routed_experts`) are allocated by
`ALLOC_MEMORY_FUNCS[device]`, whose default pins them with cudaHostRegister. A CPU engine has no device to
DMA from pinned memory, and CPU-only torch cannot pin at all, so the "cpu" entry allocates plain memory.

MLA (DeepSeek-V3's attention) picks its forward method per attention backend from
`AttentionBackendRegistry`; SGLang 0.5.23 has no entry for "torch_native" (a CPU without AMX, or any device
where the user chooses it), so it falls back to Triton's choice: the multi-head path for a prefill, which
attends over the cache as if it held keys of q's width, where MLA's cache holds the latent c_kv and the RoPE
key (kv_lora_rank + qk_rope_head_dim wide). The "torch_native" entry takes the absorbed path for every batch:
q' = [q_nope W_uk, q_pe] attends over that cache as one shared key head, the latent as value, then W_uv, the
same function (W_uk, W_uv from kv_b_proj), as SGLang's decode already does on that backend.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.models.deepseek_common import attention_backend_handler as mla_dispatch


def _alloc_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator,
                    registration_granularity_bytes: int | None = None) -> torch.Tensor:
    """SGLang's allocator signature; `pin_memory` is ignored on a CPU engine."""
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def _absorbed_mla(attn, forward_batch):
    """MLA's absorbed forward method for every batch, prefill included (SGLang's choice for a decode)."""
    return mla_dispatch._dispatch_mla_subtype(attn, forward_batch)


def register() -> None:
    """Use unpinned host buffers for engines with device="cpu" (GPU engines never look up this key), and MLA's
    absorbed path on the torch-native attention backend. Neither replaces an entry SGLang has."""
    ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_unpinned)
    if "torch_native" not in mla_dispatch.AttentionBackendRegistry._handlers:
        mla_dispatch.AttentionBackendRegistry.register("torch_native", _absorbed_mla)
