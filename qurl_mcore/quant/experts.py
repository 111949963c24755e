"""The routed experts of an MoE layer with quantized linears, all experts at once (the rollout engine's
emulated path; the trainer runs the same numerics expert by expert in Megatron's SequentialMLP)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import QuantLinearSpec, quantize_activation
from .qtensor import QTensor

#: fp32 elements of one token chunk's [experts, tokens, features] activations (256 MiB)
_CHUNK_ELEMENTS = 1 << 26


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: QTensor,
                    w2: QTensor, spec: QuantLinearSpec) -> torch.Tensor:
    """out[t] = Σ_j p[t, j] · Q̃(silu(g) ⊙ u)·Q(W2_e)ᵀ with [g; u] = Q̃(X_e)·Q(W13_e)ᵀ, e = topk_ids[t, j]
    (gate rows first in W13, as in the checkpoint's merge order and Megatron's fc1), for stacked
    experts w13 [E, 2I, H] and w2 [E, H, I] (`weights.empty_stack`). X_e holds the tokens routed to e, each
    quantized on its own as the trainer's expert e quantizes it (`quantize_activation`), so Q̃(X) is taken
    once for all experts. Tokens routed to ids outside [0, E) (padding, other EP ranks) contribute nothing;
    the weighted sum is taken in fp32.

    All experts run at once on [E, tokens, H] with the unrouted rows zero (a zero row quantizes to zero): a
    few batched GEMMs with static shapes and no read-back to the host, so CUDA graphs capture it and
    torch.compile traces it whole, at E/k times the routed FLOPs (the emulated formats' price for that).
    Tokens go in chunks that bound the activations' memory (_CHUNK_ELEMENTS), which changes no number.
    Layer outputs are rounded to x's dtype as the trainer's quantized linears round theirs."""
    experts = w13.shape[0]
    slots = (topk_ids >= 0) & (topk_ids < experts)
    index = torch.where(slots, topk_ids, 0).long()
    zeros = torch.zeros(x.shape[0], experts, dtype=torch.float32, device=x.device)
    routing = zeros.scatter_add(1, index, torch.where(slots, topk_weights.float(), 0.0))  # [T, E]
    routed = zeros.scatter_add(1, index, slots.float()) > 0
    w13_f, w2_f = w13.dequantize(torch.float32).transpose(1, 2), w2.dequantize(torch.float32).transpose(1, 2)
    chunk = max(1, _CHUNK_ELEMENTS // (experts * max(w13.shape[1], w13.shape[2])))
    out = []
    for xs, ps, rs in zip(x.split(chunk), routing.split(chunk), routed.split(chunk)):
        x_e = torch.where(rs.t()[:, :, None], quantize_activation(xs, spec), 0)  # [E, T, H]
        h = torch.bmm(x_e, w13_f).to(x.dtype)
        gate, up = h.chunk(2, dim=-1)
        hidden = F.silu(gate) * up  # unrouted rows stay zero: silu(0) * 0
        y = torch.bmm(quantize_activation(hidden, spec), w2_f).to(x.dtype)  # [E, T, H]
        out.append(torch.einsum("eth,te->th", y.float(), ps))
    return torch.cat(out).to(x.dtype)
