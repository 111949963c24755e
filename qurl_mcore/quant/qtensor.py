"""`quantize(x, fmt, granularity) -> QTensor`: real low-bit storage plus scales, and its exact inverse map.

Scaling, for a group G of elements that shares one scale (the granularity decides the groups):
  INT8 / FP8:  s = amax(G) / max_fmt (fp32),            q = RNE(clamp(x / s)),        x' = q * s
  MXFP4:       s = 2^(floor(log2 amax(G)) - 2) (E8M0),   q = E2M1(clamp(x / s, ±6)),   x' = q * s
  NVFP4:       g = amax(x) / (6 * 448) (fp32, per tensor),
               b = E4M3(amax(G) / 6 / g) per 16-element block,  q = E2M1(x / (b * g)),  x' = q * b * g
  HiF4:        per 64-element unit a = E6M2(amax(G) / 7), per 8 elements a bit b, per 4 a bit c (`hif4.py`),
               q = E1M2(x / s),  x' = q * s,  s = a * 2^b * 2^c
A group of zeros gets scale 1 (or the smallest E8M0 / a zero E4M3 block scale / a zero E6M2 scale) and decodes
to zeros.

The groups are the granularity's (`granularity.py`: per tensor, row, token, or block).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from . import hif4
from .formats import (
    E4M3_MAX, E8M0_BIAS, EXACT_IN_FP32, FormatSpec, ScaleEncoding, decode, e8m0_exponent, encode, get_format,
    pack_fp4, quotient, unpack_fp4,
)
from .granularity import Granularity, PerBlock, for_format


@dataclass
class QTensor:
    """A quantized tensor: `data` holds the codes in the original layout (INT8 as int8, FP8 as torch.float8_*,
    FP4 packed two per uint8 along the last dim), `scale` one entry per group in grouped layout
    ([groups..., 1]; fp32, or float8_e4m3fn for NVFP4 blocks, or uint8 biased exponents for MXFP4; HiF4: its
    unit's 4 scale bytes, [groups..., 4] uint8, `hif4.pack_scale`), and `global_scale` the NVFP4 per-tensor fp32
    scale. `granularity` is the one applied (a block with its size)."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: Granularity
    shape: torch.Size
    dtype: torch.dtype
    global_scale: torch.Tensor | None = None

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.fmt)

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """The (rows, cols) of a block granularity's tiles, else None."""
        return self.granularity.size if isinstance(self.granularity, PerBlock) else None

    @property
    def row_grouped(self) -> bool:
        """Whether every group lies within one row (`Granularity.row_grouped`)."""
        return self.granularity.row_grouped

    def codes(self) -> torch.Tensor:
        """The stored element codes in the original shape, unpacked for FP4."""
        if self.spec.is_fp4:
            return unpack_fp4(self.data, self.shape[-1] if len(self.shape) else 1).reshape(self.shape)
        return self.data

    def scale_fp32(self) -> torch.Tensor:
        """The decoded scale that multiplies the element values, fp32 [groups..., parts]: one per group (parts 1),
        HiF4 one per 4 elements of its unit (16 parts, s = a·2^b·2^c)."""
        encoding = self.spec.scale_encoding
        if encoding is ScaleEncoding.HIF4:
            return hif4.sub_scales(*hif4.unpack_scale(self.scale))
        if encoding is ScaleEncoding.E8M0:
            return torch.exp2(self.scale.to(torch.float32) - E8M0_BIAS)
        if encoding is ScaleEncoding.E4M3_FP32 and self.global_scale is not None:  # one per tensor of a batch
            scale = self.scale.to(torch.float32)
            glob = self.global_scale.reshape(-1, 1)
            return (scale.reshape(glob.shape[0], -1) * glob).reshape(scale.shape)
        return self.scale.to(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x' = decode(codes) * scale, each part of a group times its scale (`scale_fp32`), back in the original
        shape and dtype (or `dtype`). The scale is taken in group order, so a stack of row-grouped QTensors
        (`sglang.weights.empty_stack`: [E, rows, groups, 1] scales, [E] global scales) dequantizes as one."""
        groups = self.granularity.group(decode(self.codes(), self.spec), self.shape)
        scale = self.scale_fp32()
        parts = scale.shape[-1]
        values = groups.unflatten(-1, (parts, -1)) * scale.reshape(*groups.shape[:-1], parts, 1)
        return self.granularity.ungroup(values.flatten(-2), self.shape).to(dtype or self.dtype)


_NO_HOST_READS: ContextVar[bool] = ContextVar("no_host_reads", default=False)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Within: `quantize` reads nothing back to the host (no per-call GPU synchronization), so a non-finite
    input gives NaN scales and values instead of raising. The trainer's quantized GEMMs run so: a NaN reaches
    the loss and the gradient norm, and the step skips that update."""
    token = _NO_HOST_READS.set(True)
    try:
        yield
    finally:
        _NO_HOST_READS.reset(token)


def _in_graph(x: torch.Tensor) -> bool:
    """Whether this call is being compiled (torch.compile) or captured (a CUDA graph), or runs under
    `no_host_reads`: then nothing may wait for the host, and a non-finite input propagates as NaN instead of
    raising."""
    return (torch.compiler.is_compiling() or _NO_HOST_READS.get()
            or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise a ValueError if x holds NaN or inf: quantizing those would silently poison every scale. (Skipped
    inside a compiled or captured graph and under `no_host_reads`, where reading the answer back would stall
    the device.)"""
    if _in_graph(x):
        return
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"cannot quantize a {what} with {bad} non-finite value(s) (NaN/inf) of shape {tuple(x.shape)}; "
            "find where they come from (overflowing activations, a diverged update) and fix that first"
        )


def quantize(
    x: torch.Tensor, fmt: str, granularity: Granularity | str, *, block_shape: tuple[int, int] | None = None,
    batch_dims: int = 0,
) -> QTensor:
    """Quantize `x` to format `fmt` with one scale per group of `granularity` (a `Granularity` or its name;
    `block_shape` gives a "block" its tiles). `batch_dims` 1: x[i] are separate tensors (NVFP4: one per-tensor
    scale each, `global_scale` [len(x)]); it needs groups of one row (channel, token, 1 x n blocks), which
    never span two of them."""
    spec = get_format(fmt)
    gran = for_format(granularity, spec, block_shape)
    if batch_dims not in (0, 1):
        raise ValueError(f"batch_dims={batch_dims}: use 0 (one tensor) or 1 (a batch of tensors along dim 0)")
    if batch_dims and not gran.row_grouped:
        block = gran.size if isinstance(gran, PerBlock) else ""
        raise ValueError(f"batch_dims=1 needs groups of one row; {gran} {block} groups span rows")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")
    # A NaN or inf anywhere shows in its group's amax, so the finiteness check reads the amax, not all of x.
    g = gran.group(x.detach(), x.shape)
    if spec.scale_encoding is ScaleEncoding.HIF4:
        return _quantize_hif4(x, g, spec, gran)
    # BF16/FP16 go to fp32 before the amax, not in the division (`quotient`): the same values (exact), and a CPU
    # reduces fp32 rows about 5x faster than BF16 ones; the division then reuses this copy in place
    widened = g.dtype in EXACT_IN_FP32
    if widened:
        g = g.to(torch.float32)
    amax = torch.maximum(g.amax(dim=-1, keepdim=True), g.amin(dim=-1, keepdim=True).neg()).to(torch.float32)
    if not _in_graph(x) and not bool(torch.isfinite(amax).all()):
        check_finite(x)
    global_scale = None
    if spec.scale_encoding is ScaleEncoding.E8M0:
        exponent = e8m0_exponent(amax)
        scale_dec = torch.exp2(exponent.to(torch.float32))
        # E8M0's NaN (255, decoding to inf here) for a non-finite group, which is then never lost
        scale = torch.where(amax.isfinite(), exponent + E8M0_BIAS, 255).to(torch.uint8)
    elif spec.scale_encoding is ScaleEncoding.E4M3_FP32 and isinstance(gran, PerBlock):
        per_tensor = amax.reshape(x.shape[0] if batch_dims else 1, -1)
        tensor_amax = per_tensor.amax(dim=-1, keepdim=True)
        glob = torch.where(tensor_amax != 0, quotient(tensor_amax, spec.max_value * E4M3_MAX), 1.0)
        glob_groups = glob.expand_as(per_tensor).reshape(amax.shape)
        scale = quotient(quotient(amax, spec.max_value), glob_groups).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale_dec = scale.to(torch.float32) * glob_groups
        global_scale = glob.reshape(-1) if batch_dims else glob.reshape(())
    else:
        scale = torch.where(amax != 0, quotient(amax, spec.max_value), torch.ones_like(amax))  # NaN stays NaN
        scale_dec = scale
    positive = scale_dec > 0
    scaled = quotient(g, torch.where(positive, scale_dec, 1.0), inplace=widened)
    # An NVFP4 block scale that underflowed (a tiny block next to a huge one) encodes zeros. Elsewhere a zero
    # scale means amax / max_fmt underflowed: the group's values, divided by 1, round to zero by themselves.
    if global_scale is not None:
        scaled.masked_fill_(~positive, 0.0)
    codes = gran.ungroup(encode(scaled, spec), x.shape)  # storage drops the padding of partial blocks
    data = pack_fp4(codes.reshape(-1) if codes.dim() == 0 else codes) if spec.is_fp4 else codes
    return QTensor(data, scale, fmt, gran, x.shape, x.dtype, global_scale)


def _quantize_hif4(x: torch.Tensor, units: torch.Tensor, spec: FormatSpec, gran: Granularity) -> QTensor:
    """HiF4 of x, grouped into its 64-element units (`units` [rows, units, 64]): `hif4.quantize_units`, codes
    packed as every FP4 format's, the three levels of scale packed into 4 bytes a unit (`hif4.pack_scale`).
    Each unit is scaled on its own (no per-tensor scale), so batch_dims changes nothing."""
    if not _in_graph(x) and not bool(torch.isfinite(units).all()):
        check_finite(x)
    codes, unit_scale, micro8, micro4 = hif4.quantize_units(units)
    codes = gran.ungroup(codes, x.shape)  # storage drops the padding of a partial unit
    data = pack_fp4(codes.reshape(-1) if codes.dim() == 0 else codes)
    return QTensor(data, hif4.pack_scale(unit_scale, micro8, micro4), spec.name, gran, x.shape, x.dtype)
