"""SGLang's CPU engine, completed through SGLang's own registries and plugin hooks (no source patch).

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

Qwen2-MoE's shared expert is gated, y += sigmoid(x·w_gate)·shared(x), which SGLang 0.5.23 computes with a
fused Triton kernel unless the gate runs on the AMX backend; Triton has no CPU driver ("0 active drivers"), so
on host tensors the plugin's hook computes the same sum with torch ops (in fp32, as the kernel does).
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.models.deepseek_common import attention_backend_handler as mla_dispatch


def _alloc_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator,
                    registration_granularity_bytes: int | None = None) -> torch.Tensor:
    """SGLang's allocator signature; `pin_memory` is ignored on a CPU engine."""
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


#: Qwen2-MoE's fused shared-expert gate, as the model module calls it
SHARED_GATE = "sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add"
_hooked = False


def _shared_gate_on_host(original, hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                         shared_output: torch.Tensor, final_hidden_states: torch.Tensor) -> None:
    """final += sigmoid(hidden · w_gate) · shared, in place; SGLang's Triton kernel on device tensors."""
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, final_hidden_states)
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    final_hidden_states.copy_(final_hidden_states.float() + gate[:, None] * shared_output.float())


def register() -> None:
    """Use unpinned host buffers for engines with device="cpu" (GPU engines never look up this key), MLA's
    absorbed path on the torch-native attention backend, and Qwen2-MoE's shared-expert gate on host tensors.
    None replaces an entry SGLang has. Idempotent."""
    global _hooked
    ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_unpinned)
    if "torch_native" not in mla_dispatch.AttentionBackendRegistry._handlers:
        # SGLang's own choice for a decode (absorbed MLA), for every batch
        mla_dispatch.AttentionBackendRegistry.register("torch_native", mla_dispatch._dispatch_mla_subtype)
    if not _hooked:
        HookRegistry.register(SHARED_GATE, _shared_gate_on_host, HookType.AROUND)
        _hooked = True
