"""`quantize(x, fmt, granularity) -> QTensor`: real low-bit storage plus scales, and its exact inverse map.

Scaling, for a group G of elements that shares one scale (the granularity decides the groups):
  INT8 / FP8:  s = amax(G) / max_fmt (fp32),            q = RNE(clamp(x / s)),        x' = q * s
  MXFP4:       s = 2^(floor(log2 amax(G)) - 2) (E8M0),   q = E2M1(clamp(x / s, ±6)),   x' = q * s
  NVFP4:       g = amax(x) / (6 * 448) (fp32, per tensor),
               b = E4M3(amax(G) / 6 / g) per 16-element block,  q = E2M1(x / (b * g)),  x' = q * b * g
A group of zeros gets scale 1 (or the smallest E8M0 / a zero E4M3 block scale) and decodes to zeros.

Granularities (the last dim is the reduction dim: weights are [out, in], activations [tokens, hidden]):
  "tensor"  one scale for the whole tensor;
  "channel" one scale per output row of a weight (everything but the last dim indexes a row);
  "token"   one scale per token row of activations (same grouping as "channel", named for its use);
  "block"   FP4: the format's own 1x16 (NVFP4) / 1x32 (MXFP4) blocks; INT8/FP8: `block_shape` tiles,
            1x128 by default (activations) and `WEIGHT_BLOCK` = 128x128 for weights. Partial edge
            blocks are zero-padded, which changes no amax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E4M3_MAX, E8M0_BIAS, FormatSpec, decode, e8m0_exponent, encode, get_format, pack_fp4, unpack_fp4

GRANULARITIES = ("tensor", "channel", "token", "block")
ACT_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)


@dataclass(frozen=True)
class _Grouping:
    """A reversible view of a tensor as [groups..., elements-per-group] (the last dim shares one scale)."""

    shape: torch.Size
    granularity: str
    block_shape: tuple[int, int] | None

    def group(self, x: torch.Tensor) -> torch.Tensor:
        if self.granularity == "tensor":
            return x.reshape(1, -1)
        k = self.shape[-1] if len(self.shape) else 1
        rows = x.reshape(-1, k)
        if self.granularity in ("channel", "token"):
            return rows
        br, bc = self.block_shape
        m = rows.shape[0]
        rows = torch.nn.functional.pad(rows, (0, -k % bc, 0, -m % br))
        mp, kp = rows.shape
        return rows.reshape(mp // br, br, kp // bc, bc).transpose(1, 2).reshape(mp // br, kp // bc, br * bc)

    def ungroup(self, g: torch.Tensor) -> torch.Tensor:
        if self.granularity in ("tensor", "channel", "token"):
            return g.reshape(self.shape)
        br, bc = self.block_shape
        k = self.shape[-1] if len(self.shape) else 1
        m = self.shape.numel() // k
        mb, kb, _ = g.shape
        rows = g.reshape(mb, kb, br, bc).transpose(1, 2).reshape(mb * br, kb * bc)
        return rows[:m, :k].reshape(self.shape)


@dataclass
class QTensor:
    """A quantized tensor: `data` holds the codes in the original layout (INT8 as int8, FP8 as torch.float8_*,
    FP4 packed two per uint8 along the last dim), `scale` one entry per group in grouped layout
    ([groups..., 1]; fp32, or float8_e4m3fn for NVFP4 blocks, or uint8 biased exponents for MXFP4), and
    `global_scale` the NVFP4 per-tensor fp32 scale."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: str
    shape: torch.Size
    dtype: torch.dtype
    block_shape: tuple[int, int] | None = None
    global_scale: torch.Tensor | None = None

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.fmt)

    @property
    def row_grouped(self) -> bool:
        """Whether every group lies within one row (`row_grouped`)."""
        return row_grouped(self.granularity, self.block_shape)

    def _grouping(self) -> _Grouping:
        return _Grouping(self.shape, self.granularity, self.block_shape)

    def codes(self) -> torch.Tensor:
        """The stored element codes in the original shape, unpacked for FP4."""
        if self.spec.is_fp4:
            return unpack_fp4(self.data, self.shape[-1] if len(self.shape) else 1).reshape(self.shape)
        return self.data

    def scale_fp32(self) -> torch.Tensor:
        """The decoded per-group scale ([groups..., 1], fp32) that multiplies the element values."""
        encoding = self.spec.scale_encoding
        if encoding == "e8m0":
            return torch.exp2(self.scale.to(torch.float32) - E8M0_BIAS)
        if encoding == "e4m3_fp32" and self.global_scale is not None:  # one global scale per tensor of a batch
            scale = self.scale.to(torch.float32)
            glob = self.global_scale.reshape(-1, 1)
            return (scale.reshape(glob.shape[0], -1) * glob).reshape(scale.shape)
        return self.scale.to(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x' = decode(codes) * scale, back in the original shape and dtype (or `dtype`). The scale is taken
        in group order, so a stack of row-grouped QTensors (`sglang.weights.stack`: [E, rows, groups, 1]
        scales, [E] global scales) dequantizes as one."""
        grouping = self._grouping()
        groups = grouping.group(decode(self.codes(), self.spec))
        values = groups * self.scale_fp32().reshape(*groups.shape[:-1], 1)
        return grouping.ungroup(values).to(dtype or self.dtype)


def row_grouped(granularity: str, block_shape: tuple[int, int] | None) -> bool:
    """Whether groups of `granularity` lie within one row (channel, token, 1 x n blocks): then rows, or
    tensors stacked along dim 0, quantize independently of each other."""
    return granularity != "tensor" and (granularity != "block" or block_shape[0] == 1)


def _in_graph(x: torch.Tensor) -> bool:
    """Whether this call is being compiled (torch.compile) or captured (a CUDA graph): then nothing may wait
    for the host, and a non-finite input propagates as NaN instead of raising."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise a ValueError if x holds NaN or inf: quantizing those would silently poison every scale. (Skipped
    inside a compiled or captured graph, where reading the answer back would stall it.)"""
    if _in_graph(x):
        return
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"cannot quantize a {what} with {bad} non-finite value(s) (NaN/inf) of shape {tuple(x.shape)}; "
            "find where they come from (overflowing activations, a diverged update) and fix that first"
        )


def _resolve_block(spec: FormatSpec, granularity: str, block_shape: tuple[int, int] | None):
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; use one of {list(GRANULARITIES)}")
    if granularity != "block":
        if block_shape is not None:
            raise ValueError("block_shape only applies to granularity='block'")
        return None
    if spec.is_fp4:
        native = (1, spec.block)
        if block_shape not in (None, native):
            raise ValueError(f"{spec.name} blocks are fixed at {native}; drop block_shape={block_shape}")
        return native
    block_shape = tuple(block_shape or ACT_BLOCK)
    if len(block_shape) != 2 or min(block_shape) < 1:
        raise ValueError(f"block_shape must be two positive ints (rows, cols), got {block_shape}")
    return block_shape


def quantize(
    x: torch.Tensor, fmt: str, granularity: str, *, block_shape: tuple[int, int] | None = None,
    batch_dims: int = 0,
) -> QTensor:
    """Quantize `x` to format `fmt` with one scale per group of `granularity` (see the module docstring).
    `batch_dims` 1: x[i] are separate tensors (NVFP4: one per-tensor scale each, `global_scale` [len(x)]);
    it needs groups of one row (channel, token, 1 x n blocks), which never span two of them."""
    spec = get_format(fmt)
    block = _resolve_block(spec, granularity, block_shape)
    if batch_dims not in (0, 1):
        raise ValueError(f"batch_dims={batch_dims}: use 0 (one tensor) or 1 (a batch of tensors along dim 0)")
    if batch_dims and not row_grouped(granularity, block):
        raise ValueError(f"batch_dims=1 needs groups of one row; {granularity} {block or ''} groups span rows")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")
    grouping = _Grouping(x.shape, granularity, block)
    # x stays in its dtype until the division below promotes it to fp32 (the same values, one pass fewer); a
    # NaN or inf anywhere shows in its group's amax, so the finiteness check reads the amax, not all of x
    g = grouping.group(x.detach())
    amax = torch.maximum(g.amax(dim=-1, keepdim=True), g.amin(dim=-1, keepdim=True).neg()).to(torch.float32)
    if not _in_graph(x) and not bool(torch.isfinite(amax).all()):
        check_finite(x)
    global_scale = None
    if spec.scale_encoding == "e8m0":
        exponent = e8m0_exponent(amax)
        scale_dec = torch.exp2(exponent.to(torch.float32))
        scale = (exponent + E8M0_BIAS).to(torch.uint8)
    elif spec.scale_encoding == "e4m3_fp32" and granularity == "block":
        per_tensor = amax.reshape(x.shape[0] if batch_dims else 1, -1)
        tensor_amax = per_tensor.amax(dim=-1, keepdim=True)
        glob = torch.where(tensor_amax > 0, tensor_amax / (spec.max_value * E4M3_MAX), 1.0)
        glob_groups = glob.expand_as(per_tensor).reshape(amax.shape)
        scale = (amax / spec.max_value / glob_groups).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale_dec = scale.to(torch.float32) * glob_groups
        global_scale = glob.reshape(-1) if batch_dims else glob.reshape(())
    else:
        scale = torch.where(amax > 0, amax / spec.max_value, torch.ones_like(amax))
        scale_dec = scale
    positive = scale_dec > 0
    scaled = torch.div(g, torch.where(positive, scale_dec, 1.0))
    # An NVFP4 block scale that underflowed (a tiny block next to a huge one) encodes zeros. Elsewhere a zero
    # scale means amax / max_fmt underflowed: the group's values, divided by 1, round to zero by themselves.
    if global_scale is not None:
        scaled.masked_fill_(~positive, 0.0)
    codes = grouping.ungroup(encode(scaled, spec))  # storage drops the padding of partial blocks
    data = pack_fp4(codes.reshape(-1) if codes.dim() == 0 else codes) if spec.is_fp4 else codes
    return QTensor(data, scale, fmt, granularity, x.shape, x.dtype, block, global_scale)
