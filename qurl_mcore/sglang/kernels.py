"""GPU path: SGLang's own W8A8 kernels on weights quantized by `qurl_mcore.quant`.

Weights are quantized exactly as the trainer does (per-channel INT8 / FP8 E4M3, `quantize_weight`); the
activations are quantized per token by SGLang's fused kernels and the GEMMs run in SGLang's INT8 / FP8
kernels (dense: `int8_scaled_mm`, `apply_fp8_linear`; MoE: the Triton fused-MoE runner with per-channel
scales). Y = s_x[m] · s_w[n] · Σ_k q_x[m, k] · q_w[n, k] is the same product as the CPU path; only the
activation quantizers differ, and on bf16 activations only at exact ties, by one code (SGLang's INT8 kernel
multiplies by 127 / amax and rounds halves away from zero, its FP8 kernel multiplies by 1 / s; `quantize`
divides and rounds halves to even: tests/kernels/test_sglang_w8a8_moe.py, docs/rollout.md). Everything else (FP4, other devices) runs `qurl_mcore.quant` itself, and so
does a dense INT8 linear on a GPU that `int8_scaled_mm` has no kernel for (SM100, B200): there
`quantized_linear` multiplies the same codes with `torch._int_mm` (cuBLASLt) and applies the two scales.
"""
from __future__ import annotations

import torch

from qurl_mcore.quant import FORMATS, Family, FormatSpec, QTensor
from qurl_mcore.quant.formats import SGLANG_W8A8

#: formats that SGLang's W8A8 kernels take, with their per-channel weights and per-token activations
KERNEL_FORMATS = tuple(name for name, spec in FORMATS.items() if SGLANG_W8A8 in spec.kernels)


#: the compute capabilities sgl-kernel's `int8_scaled_mm` has kernels for, [first, last]: its CUTLASS builds for
#: SM75, SM80, SM89 and SM90; it raises on any other (SM100, B200, included)
INT8_SCALED_MM_CAPABILITIES = ((7, 5), (9, 0))


def int8_scaled_mm_runs(capability: tuple[int, int]) -> bool:
    """Whether sgl-kernel's `int8_scaled_mm` runs on a GPU of compute `capability` (major, minor)."""
    first, last = INT8_SCALED_MM_CAPABILITIES
    return first <= tuple(capability) <= last


def available(spec: FormatSpec, device: torch.device) -> bool:
    """Whether the SGLang kernel path serves format `spec` on `device` (CUDA with SGLang's W8A8 kernels: the
    Triton fused-MoE runner for experts; `linear_available` adds the dense GEMM's own limits)."""
    if SGLANG_W8A8 not in spec.kernels or device.type != "cuda":
        return False
    if spec.family is Family.FP8:
        # SGLang only where an engine runs: preflight imports this module without it
        from sglang.srt.layers.quantization.fp8_utils import cutlass_fp8_supported

        return bool(cutlass_fp8_supported())  # its per-token x per-channel epilogue
    return True


def linear_available(spec: FormatSpec, device: torch.device) -> bool:
    """Whether a dense linear of format `spec` runs SGLang's W8A8 GEMM on `device` (`w8a8_linear`): INT8 only
    where `int8_scaled_mm` has a kernel for the device's capability (`int8_scaled_mm_runs`)."""
    if not available(spec, device):
        return False
    return spec.family is not Family.INT or int8_scaled_mm_runs(torch.cuda.get_device_capability(device))


def w8a8_linear(x: torch.Tensor, wq: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Y = Q_token(X) · Q_channel(W)ᵀ + b with SGLang's per-token quantization and GEMM kernels."""
    x2 = x.reshape(-1, x.shape[-1])
    if wq.spec.family is Family.INT:
        # sgl_kernel and SGLang only where an engine runs: preflight imports this module without them
        from sgl_kernel import int8_scaled_mm
        from sglang.kernels.ops.quantization.int8_kernel import per_token_quant_int8

        xq, xs = per_token_quant_int8(x2)
        y = int8_scaled_mm(xq, wq.data.t(), xs, wq.scale, out_dtype=x.dtype, bias=bias)
    else:
        # SGLang only where an engine runs: preflight imports this module without it
        from sglang.srt.layers.quantization.fp8_utils import apply_fp8_linear

        y = apply_fp8_linear(x2, wq.data.t(), wq.scale.reshape(1, -1), bias=bias, use_per_token_if_dynamic=True)
    return y.reshape(*x.shape[:-1], -1)


def moe_quant_info(spec: FormatSpec, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                   w2_scale: torch.Tensor):
    """The Triton fused-MoE runner's description of stacked per-channel W8A8 experts of format `spec` ([E, N, K]
    codes, [E, N, 1] fp32 scales) with dynamic per-token activations."""
    # SGLang only where an engine runs: preflight imports this module without it
    from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo

    return TritonMoeQuantInfo(
        w13_weight=w13, w2_weight=w2, w13_scale=w13_scale, w2_scale=w2_scale, per_channel_quant=True,
        use_int8_w8a8=spec.family is Family.INT, use_fp8_w8a8=spec.family is Family.FP8,
    )
