"""The quantized linear layer shared by the trainer and the rollout engine (MoEResQ's symmetric RC).

With RC(t) = Q(t) + Q(t - Q(t)) and Q̃ = RC or Q as the mode says:
  forward   Y  = Q̃_fwd(X) · Q(W)ᵀ + b           (RC(X)·Q(W)ᵀ on a GEMM kernel is two GEMMs: Q(X)Q(W)ᵀ + Q(ΔX)Q(W)ᵀ)
  backward  dX = Q̃_bwd(dY) · Q(W)
            dW = Q̃_bwd(dY)ᵀ · Q̃_bwd(X)
            db = Σ_tokens dY
Modes name where RC applies, MoEResQ's ablation axis: "bf16" (no quantization), "rc_none" (Q everywhere, no
residual correction: MoEResQ's plain-FP4 baseline row), "rc_forward" (RC in the forward only), "rc_backward"
(RC in the backward only), "rc_both" (RC in both: the symmetric recipe).
Each operand is quantized along its last dim with its own granularity (W per channel/block, X and dY per
token/block), the simulated-quantization convention of the papers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .fake import residual_quantize
from .formats import FORMATS, get_format
from .gemm import BACKENDS, quantized_matmul_sum
from .granularity import GRANULARITIES, Granularity, PerBlock, PerRow, PerToken, for_format
from .grouped import Groups, grouped_mm
from .qtensor import QTensor, no_host_reads, quantize

MODES = ("bf16", "rc_none", "rc_forward", "rc_backward", "rc_both")


@dataclass(frozen=True)
class QuantLinearSpec:
    """How one linear layer quantizes. Build it with `make_spec`, which fills format-appropriate defaults (the
    granularities as `quantize` applies them, blocks with their size)."""

    mode: str = "bf16"
    fmt: str | None = None
    weight_granularity: Granularity = PerRow()
    act_granularity: Granularity = PerToken()
    grad_granularity: Granularity = PerToken()
    backend: str = "auto"

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    @property
    def rc_forward(self) -> bool:
        return self.mode in ("rc_forward", "rc_both")

    @property
    def rc_backward(self) -> bool:
        return self.mode in ("rc_backward", "rc_both")


def make_spec(
    mode: str,
    fmt: str | None = None,
    *,
    weight_granularity: Granularity | str | None = None,
    act_granularity: Granularity | str | None = None,
    grad_granularity: Granularity | str | None = None,
    backend: str = "auto",
) -> QuantLinearSpec:
    """A validated spec; a granularity is a `Granularity` or its name. Defaults: FP4 formats use their own
    blocks everywhere; INT8/FP8 use per-channel weights and per-token activations and gradients (W8A8)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantized-linear mode {mode!r}; use one of {list(MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; use one of {list(BACKENDS)}")
    if mode == "bf16":
        if fmt is not None:
            raise ValueError(f"mode 'bf16' quantizes nothing; drop fmt={fmt!r} or pick a quantized mode")
        return QuantLinearSpec(backend=backend)
    if fmt is None:
        raise ValueError(f"mode {mode!r} needs a format: fmt= one of {', '.join(FORMATS)}")
    spec = get_format(fmt)
    default = PerBlock() if spec.is_fp4 else None
    grans = {
        "weight_granularity": weight_granularity or default or PerRow(),
        "act_granularity": act_granularity or default or PerToken(),
        "grad_granularity": grad_granularity or default or PerToken(),
    }
    for name, value in grans.items():
        if isinstance(value, str) and value not in GRANULARITIES:
            raise ValueError(f"{name}={value!r} is not a granularity; use one of {list(GRANULARITIES)}")
    grans = {name: for_format(value, spec) for name, value in grans.items()}
    return QuantLinearSpec(mode, fmt, backend=backend, **grans)


def quantize_weight(weight: torch.Tensor, spec: QuantLinearSpec) -> QTensor:
    """Q(W) as the layer uses it; the rollout engine calls this once per weight update. A stack of expert
    weights [E, out, in] is quantized in one call, each expert as its own tensor (NVFP4: its own global scale;
    the weight granularity must group within rows, `Granularity.row_grouped`)."""
    return quantize(weight, spec.fmt, spec.weight_granularity, batch_dims=int(weight.dim() == 3))


@functools.cache
def _compiled_quantize_weight():
    # dynamic shapes: one graph serves every weight shape of a spec (recompiled per spec and weight dtype)
    return torch.compile(quantize_weight, fullgraph=True, dynamic=True)


def quantize_weight_compiled(weight: torch.Tensor, spec: QuantLinearSpec) -> QTensor:
    """`quantize_weight` fused by torch.compile: bitwise the same QTensor in fewer passes over W (on GPUs too,
    `formats.quotient`; torch 2.11's inductor changes an NVFP4 block scale in about 1 of 2M: docs/megatron.md).
    The first call per spec compiles (seconds; a C++ compiler on CPU, Triton on GPU)."""
    return _compiled_quantize_weight()(weight, spec)


def _quantize_activation(x2: torch.Tensor, spec: QuantLinearSpec, granularity: Granularity, residual: bool):
    """[Q(x)] or [Q(x), Q(x - Q(x))] of x2 [tokens, in], token by token: with groups that lie within a row
    (token, 1 x n blocks), each row is its own tensor (NVFP4: its own fp32 scale), so a token's codes depend on
    that token alone, not on what the trainer's micro-batch or the engine's prefill or decode batch holds beside
    it. That is what lets both sides compute the same function of a token."""
    batch_dims = int(granularity.row_grouped)
    if residual:
        return list(residual_quantize(x2, spec.fmt, granularity, batch_dims=batch_dims))
    return [quantize(x2, spec.fmt, granularity, batch_dims=batch_dims)]


def _dequantized_sum(parts: list[QTensor]) -> torch.Tensor:
    return sum(p.dequantize(torch.float32) for p in parts)


def quantize_activation(x: torch.Tensor, spec: QuantLinearSpec) -> torch.Tensor:
    """Q̃_fwd(X) as the fp32 values the forward multiplies (RC: Q(X) + Q(X − Q(X))), token by token, for
    x [..., in]."""
    x2 = x.reshape(-1, x.shape[-1])
    return _dequantized_sum(_quantize_activation(x2, spec, spec.act_granularity, spec.rc_forward)).reshape(x.shape)


def _forward(x2: torch.Tensor, wq: QTensor, spec: QuantLinearSpec, keep_residual: bool,
             w_values: torch.Tensor | None = None, groups: Groups | None = None):
    """Y = Q̃_fwd(X)·Q(W)ᵀ in fp32, plus the activation parts (with the residual if RC needs it anywhere);
    `w_values`: Q(W)'s fp32 values if the caller has them (required with `groups`: row group g of X times
    expert g of a stacked W, emulated)."""
    parts = _quantize_activation(x2, spec, spec.act_granularity, spec.rc_forward or keep_residual)
    gemm_parts = parts if spec.rc_forward else parts[:1]
    if groups is not None:
        return grouped_mm(_dequantized_sum(gemm_parts), w_values.mT, groups), parts
    y = quantized_matmul_sum(gemm_parts, wq, backend=spec.backend, b_values=w_values)
    return y, parts


def _mm(a: torch.Tensor, b: torch.Tensor, groups: Groups | None) -> torch.Tensor:
    return a @ b if groups is None else grouped_mm(a, b, groups)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def quantized_linear(
    x: torch.Tensor, weight_q: QTensor, bias: torch.Tensor | None, spec: QuantLinearSpec
) -> torch.Tensor:
    """Inference: Y = Q̃_fwd(X)·Q(W)ᵀ + b with an already quantized weight (no autograd)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.shape[0]:  # no tokens (an expert none was routed to): nothing to quantize
        return x.new_empty(*x.shape[:-1], weight_q.shape[0])
    y, _ = _forward(x2, weight_q, spec, keep_residual=False)
    return _add_bias(y, bias).to(x.dtype).reshape(*x.shape[:-1], -1)


class QuantLinearFunction(torch.autograd.Function):
    """Training: the forward and backward of the module docstring; weights are re-quantized every call, with
    nothing read back to the host (`no_host_reads`: a non-finite value turns the loss NaN, and the step skips).
    With `groups`, x's rows are an MoE layer's tokens sorted by expert and weight [E, out, in] stacks the
    experts': every product is a grouped GEMM (`grouped.grouped_mm`), the weights are quantized in one call,
    and the numbers are those of one such linear per expert (quantization is per token: row-grouped)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: QuantLinearSpec, groups: Groups | None = None):
        with no_host_reads():
            return QuantLinearFunction._forward(ctx, x, weight, bias, spec, groups)

    @staticmethod
    def backward(ctx, grad_out):
        with no_host_reads():  # the autograd engine may run this on another thread: the context is set again
            return QuantLinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, x, weight, bias, spec: QuantLinearSpec, groups: Groups | None):
        if groups is not None and bias is not None:
            raise ValueError("grouped expert linears take no bias; build the experts with add_bias_linear=False")
        ctx.spec, ctx.groups = spec, groups
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        x2 = x.reshape(-1, x.shape[-1])
        # No tokens (an MoE expert none was routed to in this micro-batch): Y is empty and dW = 0, as the
        # plain linear gives; there is no activation to quantize (a per-tensor scale of nothing is undefined).
        ctx.quantized, ctx.has_bias = spec.quantized and x2.shape[0] > 0, bias is not None
        if not ctx.quantized:
            ctx.save_for_backward(x2, weight)
            if groups is not None:
                return grouped_mm(x2, weight.mT, groups).reshape(*x.shape[:-1], -1)
            return torch.nn.functional.linear(x, weight, bias)
        wq = quantize_weight(weight, spec)
        w_values = wq.dequantize(torch.float32)  # the backward's dX = Q̃(dY)·Q(W) needs them too: decoded once
        y, parts = _forward(x2, wq, spec, keep_residual=spec.rc_backward, w_values=w_values, groups=groups)
        x_for_dw = _dequantized_sum(parts if spec.rc_backward else parts[:1])
        ctx.save_for_backward(x_for_dw, w_values)
        return _add_bias(y, bias).to(x.dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def _backward(ctx, grad_out):
        spec = ctx.spec
        x_saved, w_saved = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.quantized:
            gparts = _quantize_activation(g2.to(torch.float32), spec, spec.grad_granularity, spec.rc_backward)
            gq = _dequantized_sum(gparts)
        else:
            gq = g2
        grad_x = _mm(gq, w_saved, ctx.groups).to(ctx.x_dtype).reshape(*grad_out.shape[:-1], w_saved.shape[-1])
        grad_w = _mm(gq.t(), x_saved, ctx.groups).to(ctx.w_dtype)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def quant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, spec: QuantLinearSpec,
    groups: Groups | None = None
) -> torch.Tensor:
    """Differentiable quantized linear: x [..., in], weight [out, in] -> [..., out]; with `groups`, x [T, in]
    sorted by expert and the experts' stacked weight [E, out, in] -> [T, out] (`QuantLinearFunction`)."""
    return QuantLinearFunction.apply(x, weight, bias, spec, groups)
