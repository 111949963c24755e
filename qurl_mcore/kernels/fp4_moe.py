"""Host side of the FP4 kernels: the fused MoE experts and the dense FP4 linear (one expert, every row routed
to it), each the same function as its emulated reference (`quant.experts.experts_forward`,
`quant.linear.quantized_linear`) up to the order of fp32 sums (docs/rollout.md).

Each GEMM is one custom op, `qurl::fp4_moe_gemm`, that writes into a tensor the caller allocated: on a fake
device (`qurl_mcore.fakecuda`) it computes nothing and keeps the shapes, so a traced engine shows which
layers take it. Nothing here reads the host: grids are fixed by shapes (`align.capacity`)."""
from __future__ import annotations

import torch

from qurl_mcore.quant import QTensor
from qurl_mcore.quant.formats import FormatSpec, ScaleEncoding
from qurl_mcore.quant.linear import QuantLinearSpec

from . import fp4_gemm
from .align import Alignment, align, capacity

#: routed slots a program takes (tl.dot's smallest M), output columns, and reduction elements a step
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
#: the first compute capability whose MMAs take microscaled FP4 as stored (Blackwell: tcgen05's kind::mxf4)
SCALED_DOT_SM = 10
#: output columns a program takes by `tl.dot_scaled`: the weights are the MMA's M side (Cᵀ = W·Xᵀ), and
#: tcgen05's block-scaled MMA needs M = 128 (with fewer, Triton decomposes it into bf16 MMAs)
SCALED_BLOCK_N = 128


def scaled_dot(fmt: FormatSpec, device: torch.device) -> bool:
    """Whether the GEMM multiplies by `tl.dot_scaled`: MXFP4 (E2M1 codes, E8M0 scales per 32, the MX layout
    as `QTensor` stores it) on CUDA SM100 and later. NVFP4 keeps the decoded bf16 MMAs: Triton's interpreter
    decodes every dot_scaled scale as E8M0, so its E4M3 scales per 16 could not be verified on the CPU."""
    return (fmt.scale_encoding is ScaleEncoding.E8M0 and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= SCALED_DOT_SM)


@torch.library.custom_op("qurl::fp4_moe_gemm", mutates_args=("out",))
def fp4_moe_gemm(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 w_global: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                 padded: torch.Tensor, a_div: int, nv: bool, rc: bool, gated: bool, block: int,
                 scaled: bool) -> None:
    """out[slot] = Q̃(a[slot // a_div])·Q(W_e)ᵀ (gated: silu(gate)·up) for the routed slots of an alignment;
    `w` [E, N, K/2] packed codes, `w_scale` [E, N, K/block] scale bits as uint8, `w_global` [E] (NVFP4);
    `scaled`: the products by `tl.dot_scaled` (`scaled_dot`)."""
    n = out.shape[1] if gated else w.shape[1]
    k = a.shape[1]
    block_n = SCALED_BLOCK_N if scaled else BLOCK_N
    grid = (block_expert.numel(), -(-n // (block_n // 2 if gated else block_n)))
    fp4_gemm.fp4_moe_gemm[grid](
        a, a.stride(0), w, w.stride(0), w.stride(1), w_scale, w_scale.stride(0), w_scale.stride(1), w_global,
        out, out.stride(0), sorted_ids, block_expert, padded, out.shape[0], n, k,
        A_DIV=a_div, NV=nv, RC=rc, GATED=gated, SCALED=scaled, BS=block, BM=BLOCK_M, BN=block_n, BK=BLOCK_K,
        enable_fp_fusion=False)  # no FMA contraction: X − Q(X) rounds Q(X) first, as `residual_quantize` does


@fp4_moe_gemm.register_fake
def _(out, a, w, w_scale, w_global, sorted_ids, block_expert, padded, a_div, nv, rc, gated, block,
      scaled) -> None:
    return None


def _gemm(out: torch.Tensor, a: torch.Tensor, wq: QTensor, routing: Alignment, a_div: int,
          spec: QuantLinearSpec, scaled: bool, gated: bool = False) -> torch.Tensor:
    """Run `fp4_moe_gemm` for weight `wq`, stacked experts [E, N, K] or one linear's [N, K] (E = 1)."""
    fmt = wq.spec
    nv = fmt.scale_encoding is ScaleEncoding.E4M3_FP32
    rows = wq.shape[-2]
    data = wq.data.reshape(-1, rows, wq.data.shape[-1])
    scale = wq.scale.reshape(data.shape[0], rows, -1).view(torch.uint8)  # [E, N, K/block]: E4M3 or E8M0 bits
    glob = wq.global_scale.reshape(-1) if nv else scale  # MXFP4 has none: any tensor, never read
    fp4_moe_gemm(out, a, data, scale, glob, routing.sorted_ids, routing.block_expert, routing.padded,
                 a_div, nv, spec.rc_forward, gated, fmt.block, scaled)
    return out


def fp4_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: QTensor, w2: QTensor,
                spec: QuantLinearSpec, scaled: bool | None = None) -> torch.Tensor:
    """`experts_forward`'s function on the routed slots only: gate/up with SiLU fused into one GEMM (W13), the
    down projection (W2) on its output, then the routing-weighted sum over each token's k slots in fp32.
    `scaled` (MXFP4): by `tl.dot_scaled`; None: as `scaled_dot` chooses for x's device."""
    tokens, k = topk_ids.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    routing = align(topk_ids, experts, BLOCK_M)
    x = x.contiguous()
    scaled = scaled_dot(w13.spec, x.device) if scaled is None else scaled
    hidden = _gemm(x.new_empty(tokens * k, inter), x, w13, routing, k, spec, scaled, gated=True)
    y = _gemm(x.new_empty(tokens * k, x.shape[1]), hidden, w2, routing, 1, spec, scaled)
    routed = ((topk_ids >= 0) & (topk_ids < experts)).reshape(-1, 1)
    y = torch.where(routed, y, 0).float()  # the rows of slots routed elsewhere were never written
    weights = torch.where(routed, topk_weights.reshape(-1, 1).float(), 0.0)
    return (y * weights).reshape(tokens, k, -1).sum(1).to(x.dtype)


def fp4_linear(x: torch.Tensor, wq: QTensor, bias: torch.Tensor | None, spec: QuantLinearSpec,
               scaled: bool | None = None) -> torch.Tensor:
    """`quantized_linear(x, wq, bias, spec)` for an FP4 weight [N, K]: every row routed to one expert, the
    product kept in fp32 until the bias is added, then rounded to x's dtype. `scaled`: as `fp4_experts`."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    rows = x2.shape[0]
    if not rows:
        return x.new_empty(*x.shape[:-1], wq.shape[0])
    size = capacity(rows, 1, BLOCK_M)
    device = x.device
    routing = Alignment(torch.arange(size, dtype=torch.int32, device=device),
                        torch.zeros(size // BLOCK_M, dtype=torch.int32, device=device),
                        torch.full((1,), size, dtype=torch.int32, device=device), rows, BLOCK_M)
    scaled = scaled_dot(wq.spec, device) if scaled is None else scaled
    y = _gemm(torch.empty(rows, wq.shape[0], dtype=torch.float32, device=device), x2, wq, routing, 1, spec, scaled)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)
