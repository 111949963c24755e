"""The code push's wire format: quantized weights as codes and scales under HF names, and their digest.

An engine quantizes each of its linears as one tensor, its *unit*: SGLang's fused q/k/v or gate/up rows, one
expert's gate/up (w13) or down (w2). `encode_unit` quantizes a unit's HF tensors, concatenated along dim 0 in the
engine's order, with the engine's recipe, and splits the result back by rows, so that each HF weight `W` travels as

  W                  its codes (`QTensor.data`: int8, float8, or FP4 packed two per uint8 along the last dim)
  W + SCALE          its rows' scales (`QTensor.scale` rows: fp32 per row, E4M3 or E8M0 per 1 x n block, HiF4's
                     4 bytes per 64-element unit)
  W + GLOBAL_SCALE   NVFP4 only: the unit's per-tensor fp32 scale (the same for every member of the unit)

Every engine weight granularity groups within a row, so the codes and scales of a row depend on that row alone,
given the unit's global scale: loaded into the engine's fused tensor they are bitwise `quantize_weight` of the
fused full-precision rows, which is what the engine computes after a BF16 push.

An engine of tensor parallelism t holds a `Unit` in t shards and quantizes each on its own: `shard` of every
member, cut as SGLang cuts it (`Unit.split`: the rows of a column-parallel linear, q/k/v, gate/up, an expert's
w13; the columns of a row-parallel one, o_proj, down_proj, an expert's w2), concatenated along rows. A row of a
column shard has per-channel scales of its own and, NVFP4, every shard its own global scale. So the wire carries
the shards' codes and scales side by side along the split dim (SGLang's loaders, narrowing the full tensor for
their rank, read their shard's), a per-channel scale of a column-split unit as [rows, t], and the global scale as
[t] (one per shard; the engine's loader picks its rank's). At t = 1 this is the unit quantized whole.

`digest` is a cheap exact fingerprint of a unit's installed codes and scales (integer sums, so that any order
of summation on any device gives the same number), which the engine reports and the trainer compares.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
#: the dim along which an engine of TP > 1 splits a unit's members (`Unit.split`)
ROWS, COLUMNS = 0, 1


@dataclass(frozen=True)
class Unit:
    """The HF weights an engine quantizes as one tensor (`names`, in its row order), split along `split` (ROWS or
    COLUMNS) into `shards` equal parts, one per engine rank that quantizes its part on its own (module docstring)."""

    names: tuple[str, ...]
    split: int = ROWS
    shards: int = 1


def shard(w: torch.Tensor, split: int, rank: int, shards: int) -> torch.Tensor:
    """Engine rank `rank`'s part of `w` among `shards`: the rank-th of equal chunks along dim `split`, as SGLang's
    loaders narrow a full-precision weight (`narrow(split, rank · n / shards, n / shards)`)."""
    n = w.shape[split]
    if n % shards:
        raise ValueError(f"cannot split {n} {'columns' if split else 'rows'} into {shards} equal engine shards")
    return w.narrow(split, rank * (n // shards), n // shards)


def has_global_scale(spec: QuantLinearSpec) -> bool:
    """Whether a unit's codes depend on all its rows through a per-tensor scale (NVFP4's)."""
    return get_format(spec.fmt).tensor_scale_bytes > 0 and isinstance(spec.weight_granularity, PerBlock)


def encode_unit(members: Sequence[NamedTensor], spec: QuantLinearSpec,
                quantizer: Callable[[torch.Tensor, QuantLinearSpec], QTensor] = quantize_weight,
                split: int = ROWS, shards: int = 1) -> tuple[list[NamedTensor], list[QTensor]]:
    """The wire tensors (module docstring) of a unit's HF weights `members`, in the engine's row order, split along
    `split` over `shards` engine ranks, and each rank's QTensor Q(concat(shard of each member)) (what that rank
    installs; `unit_digest` reads them). `quantizer`: `quantize_weight` or `quantize_weight_compiled` (bitwise
    the same)."""
    if not spec.weight_granularity.row_grouped:
        raise ValueError(f"a code push needs weight groups of one row; {spec.weight_granularity} spans rows")
    parts = [[shard(w, split, r, shards) for _, w in members] for r in range(shards)]
    qs = [quantizer(p[0] if len(p) == 1 else torch.cat(p), spec) for p in parts]
    out: list[NamedTensor] = []
    row = 0
    for i, (name, _) in enumerate(members):
        rows = parts[0][i].shape[0]
        out += [(name, _side_by_side([q.data[row:row + rows] for q in qs], split)),
                (name + SCALE, _side_by_side([q.scale[row:row + rows] for q in qs], split))]
        if qs[0].global_scale is not None:
            out.append((name + GLOBAL_SCALE, torch.stack([q.global_scale for q in qs]).reshape(shards)))
        row += rows
    return out, qs


def _side_by_side(parts: list[torch.Tensor], split: int) -> torch.Tensor:
    """The shards' codes or scales along `split`, where the engine's loaders narrow them (a view at one shard)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, split)


def wire_specs(name: str, shape: Sequence[int], spec: QuantLinearSpec, split: int = ROWS,
               shards: int = 1) -> dict[str, tuple[torch.dtype, list[int]]]:
    """name -> (dtype, shape) of the wire tensors of HF weight `name` of full-precision `shape` ([rows, cols]), a
    member of a unit split along `split` over `shards` engine ranks."""
    fmt = get_format(spec.fmt)
    rows, cols = shape
    parts = shards if split == COLUMNS else 1  # column shards lie side by side, each with its own scales
    width = cols // parts
    codes = [rows, parts * ((width + 1) // 2)] if fmt.is_fp4 else [rows, cols]
    gran = spec.weight_granularity
    scale = [rows, parts * -(-width // gran.size[1]), fmt.scale_width] if isinstance(gran, PerBlock) else [rows, parts]
    scale_dtype = {ScaleEncoding.FP32: torch.float32, ScaleEncoding.E4M3_FP32: torch.float8_e4m3fn,
                   ScaleEncoding.E8M0: torch.uint8, ScaleEncoding.HIF4: torch.uint8}[fmt.scale_encoding]
    out = {name: (fmt.storage_dtype, codes), name + SCALE: (scale_dtype, scale)}
    if has_global_scale(spec):
        out[name + GLOBAL_SCALE] = (torch.float32, [shards])
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


def unit_digest(shard_digests: Sequence[str]) -> str:
    """A unit's fingerprint across the engine ranks that hold it: its shards' `digest`s, in rank order."""
    return ",".join(shard_digests)


@functools.cache
def _chunk_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64 on `device` (a cached chunk's worth, sliced)."""
    return _chunk_positions(device)[:n]
