"""The code push's wire format: quantized weights as codes and scales under HF names, and their digest.

An engine quantizes each of its linears as one tensor, its *unit*: SGLang's fused q/k/v or gate/up rows, one
expert's gate/up (w13) or down (w2). `encode_unit` quantizes a unit's HF tensors, concatenated along dim 0 in the
engine's order, with the engine's recipe, and splits the result back by rows, so that each HF weight `W` travels as

  W                  its codes (`QTensor.data`: int8, float8, or FP4 packed two per uint8 along the last dim)
  W + SCALE          its rows' scales (`QTensor.scale` rows: fp32 per row, E4M3 or E8M0 per 1 x n block)
  W + GLOBAL_SCALE   NVFP4 only: the unit's per-tensor fp32 scale (the same for every member of the unit)

Every engine weight granularity groups within a row, so the codes and scales of a row depend on that row alone,
given the unit's global scale: loaded into the engine's fused tensor they are bitwise `quantize_weight` of the
fused full-precision rows, which is what the engine computes after a BF16 push.

`digest` is a cheap exact fingerprint of a unit's installed codes and scales (integer sums, so that any order
of summation on any device gives the same number), which the engine reports and the trainer compares.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence

import torch

from .formats import ScaleEncoding, get_format
from .granularity import PerBlock
from .linear import QuantLinearSpec, quantize_weight
from .qtensor import QTensor

SCALE = "_scale"
GLOBAL_SCALE = "_global_scale"
NamedTensor = tuple[str, torch.Tensor]

#: int64 words per digest chunk
_CHUNK = 1 << 22


def has_global_scale(spec: QuantLinearSpec) -> bool:
    """Whether a unit's codes depend on all its rows through a per-tensor scale (NVFP4's)."""
    return get_format(spec.fmt).tensor_scale_bytes > 0 and isinstance(spec.weight_granularity, PerBlock)


def encode_unit(members: Sequence[NamedTensor], spec: QuantLinearSpec,
                quantizer: Callable[[torch.Tensor, QuantLinearSpec], QTensor] = quantize_weight,
                ) -> tuple[list[NamedTensor], QTensor]:
    """The wire tensors (module docstring) of a unit's HF weights `members`, in the engine's row order, and the
    unit's QTensor Q(concat(members)) (what the engine installs; `digest` reads it). `quantizer`: `quantize_weight`
    or `quantize_weight_compiled` (bitwise the same)."""
    if not spec.weight_granularity.row_grouped:
        raise ValueError(f"a code push needs weight groups of one row; {spec.weight_granularity} spans rows")
    weights = [w for _, w in members]
    q = quantizer(weights[0] if len(weights) == 1 else torch.cat(weights), spec)
    out: list[NamedTensor] = []
    row = 0
    for name, w in members:
        rows = w.shape[0]
        out += [(name, q.data[row:row + rows]), (name + SCALE, q.scale[row:row + rows])]
        if q.global_scale is not None:
            out.append((name + GLOBAL_SCALE, q.global_scale))
        row += rows
    return out, q


def wire_specs(name: str, shape: Sequence[int], spec: QuantLinearSpec) -> dict[str, tuple[torch.dtype, list[int]]]:
    """name -> (dtype, shape) of the wire tensors of HF weight `name` of full-precision `shape` ([rows, cols])."""
    fmt = get_format(spec.fmt)
    rows, cols = shape
    codes = [rows, (cols + 1) // 2] if fmt.is_fp4 else [rows, cols]
    gran = spec.weight_granularity
    scale = [rows, -(-cols // gran.size[1]), 1] if isinstance(gran, PerBlock) else [rows, 1]
    scale_dtype = {ScaleEncoding.FP32: torch.float32, ScaleEncoding.E4M3_FP32: torch.float8_e4m3fn,
                   ScaleEncoding.E8M0: torch.uint8}[fmt.scale_encoding]
    out = {name: (fmt.storage_dtype, codes), name + SCALE: (scale_dtype, scale)}
    if has_global_scale(spec):
        out[name + GLOBAL_SCALE] = (torch.float32, [])
    return out


def digest(q: QTensor) -> str:
    """A fingerprint of the bytes of a QTensor's codes, scales and global scale: each field's bytes read as int64
    words (the tail zero-padded), per chunk of 2^22 words Σ w and Σ w·(i + 1) over its words w at offsets i, in
    int64 arithmetic (wrapping: exact modulo 2^64, so any order and device of summation agree), hashed with the
    chunk's place. One multiply and two sums over the codes, where they are; a host sync per chunk."""
    h = hashlib.sha256()
    for field in (q.data, q.scale, q.global_scale):
        if field is not None:
            flat = field.detach().contiguous().reshape(-1).view(torch.uint8)
            if flat.numel() % 8 or flat.storage_offset() % 8:  # a copy only where an int64 view cannot be
                flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
            words = flat.view(torch.int64)
            for start in range(0, words.numel(), _CHUNK):
                w = words[start:start + _CHUNK]
                total, weighted = torch.stack([w.sum(), (w * _positions(w.numel(), w.device)).sum()]).tolist()
                h.update(f"{start}:{total}:{weighted};".encode())
        h.update(b"|")
    return h.hexdigest()[:32]


@functools.cache
def _chunk_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64 on `device` (a cached chunk's worth, sliced)."""
    return _chunk_positions(device)[:n]
