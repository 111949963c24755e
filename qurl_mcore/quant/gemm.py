"""Quantized GEMM backends for Y = A · Bᵀ with A [M, K] (per-tensor or per-token scales) and B [N, K]
(per-tensor or per-channel scales):

  Y[m, n] = s_A[m] · s_B[n] · Σ_k q_A[m, k] · q_B[n, k]

"emulated": dequantize both operands and multiply in fp32; runs for every format and granularity, and is
            the reference that the CPU path of the trainer and the rollout engine share.
"int8":     torch._int_mm (exact int32 accumulation), then the two scale vectors.
"fp8":      torch._scaled_mm on E4M3 operands with row-wise scales.
"auto" picks a kernel only for CUDA tensors whose format, granularity and shape the kernel supports: the
format names its kernels (`FormatSpec.kernels`), the granularities must give one scale per row or tensor.
"""
from __future__ import annotations

import torch

from .formats import INT_MM, SCALED_MM
from .qtensor import QTensor

KERNELS = (INT_MM, SCALED_MM)
BACKENDS = ("auto", "emulated", *KERNELS)


def _kernel_for(a: QTensor, b: QTensor) -> str | None:
    """The kernel that can run a · bᵀ exactly as quantized, or None."""
    if a.fmt != b.fmt or not (a.granularity.rowwise and b.granularity.rowwise):
        return None
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        return None
    return next((k for k in KERNELS if k in a.spec.kernels), None)


#: torch._int_mm on CUDA needs more than 16 rows: decode shapes (a few tokens) are padded with zero rows
_INT_MM_MIN_ROWS = 17
#: compute capability (major) -> whether torch._scaled_mm's row-wise kernel writes fp32 (SM90 yes, SM100 no)
ROWWISE_FP32_OUT = {9: True, 10: False}


def _cuda_shape_ok(kernel: str, m: int, n: int, k: int) -> bool:
    if kernel == INT_MM:  # cuBLASLt int8 constraints as enforced by torch._int_mm (rows: padded, below)
        return k % 8 == 0 and n % 8 == 0
    return k % 16 == 0 and n % 16 == 0


def select_backend(a: QTensor, b: QTensor) -> str:
    """What "auto" runs for these operands: a kernel on CUDA when it applies, else "emulated"."""
    kernel = _kernel_for(a, b)
    if kernel is None or a.data.device.type != "cuda":
        return "emulated"
    m, k = a.shape
    return kernel if _cuda_shape_ok(kernel, m, b.shape[0], k) else "emulated"


def _row_scales(q: QTensor, rows: int) -> torch.Tensor:
    """The operand's scale as a [rows, 1] fp32 column (a per-tensor scale is broadcast)."""
    return q.scale_fp32().reshape(-1, 1).expand(rows, 1).contiguous()


def _codes_2d(q: QTensor) -> torch.Tensor:
    return q.codes().reshape(q.shape)


def quantized_matmul_sum(parts: list[QTensor], b: QTensor, *, backend: str = "auto",
                         b_values: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i A_i · Bᵀ in fp32 (a residual-corrected operand has two parts). A kernel runs one GEMM per part and
    sums the products; emulated, it is one GEMM, (Σ_i A_i) · Bᵀ, with the parts' values summed in fp32 and B
    dequantized once (or `b_values`, B's fp32 values where the caller has them), as the MoE experts' emulated
    path (`experts.experts_forward`) multiplies."""
    if backend == "auto" and all(select_backend(a, b) == "emulated" for a in parts):
        backend = "emulated"
    if backend == "emulated":
        w = b.dequantize(torch.float32) if b_values is None else b_values
        return sum(a.dequantize(torch.float32) for a in parts) @ w.t()
    return sum(quantized_matmul(a, b, backend=backend) for a in parts)


def quantized_matmul(a: QTensor, b: QTensor, *, backend: str = "auto", out_dtype: torch.dtype = torch.float32):
    """A · Bᵀ for quantized A [..., K] and B [N, K], in `out_dtype`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; use one of {list(BACKENDS)}")
    if backend == "auto":
        backend = select_backend(a, b)
    if backend == "emulated":
        return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)
    kernel = _kernel_for(a, b)
    if kernel != backend:
        raise ValueError(
            f"backend {backend!r} cannot run {a.fmt}/{a.granularity} x {b.fmt}/{b.granularity} operands; "
            "it needs 2-D operands of one format (int8 or fp8_e4m3) with per-tensor/token/channel scales. "
            "Use backend='emulated' or 'auto'"
        )
    (m, _), n = a.shape, b.shape[0]
    scale_a, scale_b = _row_scales(a, m), _row_scales(b, n).t()
    if kernel == INT_MM:
        codes = _codes_2d(a)
        if m < _INT_MM_MIN_ROWS:  # zero rows add nothing to the rows kept; the kernel instead of a dequantize
            codes = torch.nn.functional.pad(codes, (0, 0, 0, _INT_MM_MIN_ROWS - m))
        acc = torch._int_mm(codes, _codes_2d(b).t())[:m]
        return (acc.to(torch.float32) * scale_a * scale_b).to(out_dtype)
    # row-wise scales with an fp32 output: on CUDA, SM90's kernels only; other GPUs' kernels write bf16
    cuda = a.data.device.type == "cuda"
    out = torch.bfloat16 if cuda and not ROWWISE_FP32_OUT.get(torch.cuda.get_device_capability(a.data.device)[0]) \
        else out_dtype
    return torch._scaled_mm(_codes_2d(a), _codes_2d(b).t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out).to(out_dtype)
