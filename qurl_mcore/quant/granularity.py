"""Granularities: which elements of a tensor share one scale (torchao's PerTensor / PerRow / PerToken / PerBlock).

The last dim is the reduction dim (weights are [out, in], activations [tokens, hidden]); a granularity views
a tensor as [groups..., elements per group], one scale per group:
  PerTensor      one group: the whole tensor
  PerRow         one group per output row of a weight (per channel; everything but the last dim indexes a row)
  PerToken       one group per token row of activations (PerRow's grouping, named for its use)
  PerBlock(r, c) r x c tiles. FP4 formats have their own 1 x 16 (NVFP4) / 1 x 32 (MXFP4) / 1 x 64 (HiF4, the
                 only granularity it takes) blocks; INT8/FP8
                 take `size`, 1 x 128 (`ACT_BLOCK`) by default. Partial edge tiles are zero-padded, which
                 changes no amax.
`GRANULARITIES` names them ("tensor", "channel", "token", "block"), as configs and reports spell them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .formats import FormatSpec

ACT_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)


class Granularity:
    """Base of the granularities: how a tensor of `shape` is viewed as groups of one scale each."""

    name: ClassVar[str]

    @property
    def row_grouped(self) -> bool:
        """Whether every group lies within one row: then rows, or tensors stacked along dim 0, quantize
        independently of each other."""
        return True

    @property
    def rowwise(self) -> bool:
        """Whether the scales are one per row or one per tensor: a vector a GEMM epilogue applies."""
        return True

    def group(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """x (of `shape`) as [groups..., elements per group]."""
        return x.reshape(-1, _cols(shape))

    def ungroup(self, g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of `group`: back to `shape` (dropping the padding of partial blocks)."""
        return g.reshape(shape)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _cols(shape: torch.Size) -> int:
    return shape[-1] if len(shape) else 1


@dataclass(frozen=True)
class PerTensor(Granularity):
    name: ClassVar[str] = "tensor"

    @property
    def row_grouped(self) -> bool:
        return False

    def group(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return x.reshape(1, -1)


@dataclass(frozen=True)
class PerRow(Granularity):
    name: ClassVar[str] = "channel"


@dataclass(frozen=True)
class PerToken(PerRow):
    name: ClassVar[str] = "token"


@dataclass(frozen=True)
class PerBlock(Granularity):
    """`size` (rows, cols) tiles; None: the format's own blocks (FP4) or `ACT_BLOCK` (`for_format`)."""

    size: tuple[int, int] | None = None
    name: ClassVar[str] = "block"

    @property
    def row_grouped(self) -> bool:
        return self.size is None or self.size[0] == 1  # every default block is 1 x n

    @property
    def rowwise(self) -> bool:
        return False

    def group(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        br, bc = self.size
        k = _cols(shape)
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        rows = torch.nn.functional.pad(rows, (0, -k % bc, 0, -m % br))
        mp, kp = rows.shape
        return rows.reshape(mp // br, br, kp // bc, bc).transpose(1, 2).reshape(mp // br, kp // bc, br * bc)

    def ungroup(self, g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        br, bc = self.size
        k = _cols(shape)
        m = shape.numel() // k
        mb, kb, _ = g.shape
        rows = g.reshape(mb, kb, br, bc).transpose(1, 2).reshape(mb * br, kb * bc)
        return rows[:m, :k].reshape(shape)


#: name -> granularity (a "block" of the format's default size)
GRANULARITIES: dict[str, Granularity] = {g.name: g for g in (PerTensor(), PerRow(), PerToken(), PerBlock())}


def as_granularity(granularity: Granularity | str) -> Granularity:
    """A granularity, or the one a name of `GRANULARITIES` stands for."""
    if isinstance(granularity, Granularity):
        return granularity
    if isinstance(granularity, str) and granularity in GRANULARITIES:
        return GRANULARITIES[granularity]
    raise ValueError(f"unknown granularity {granularity!r}; use one of {list(GRANULARITIES)}")


def for_format(granularity: Granularity | str, spec: FormatSpec,
               block_shape: tuple[int, int] | None = None) -> Granularity:
    """The granularity `quantize` applies for format `spec`: a block's size filled in (the format's own
    blocks for FP4, `block_shape` or `ACT_BLOCK` otherwise) and checked."""
    g = as_granularity(granularity)
    if not isinstance(g, PerBlock):
        if block_shape is not None:
            raise ValueError("block_shape only applies to granularity='block'")
        if spec.blocks_only:
            raise ValueError(f"{spec.name} scales its own 1 x {spec.block} units of a row, not per {g}; "
                             "use granularity 'block'")
        return g
    if block_shape is not None and g.size not in (None, tuple(block_shape)):
        raise ValueError(f"{g} gives its block as {g.size}; drop block_shape={block_shape}")
    shape = block_shape if block_shape is not None else g.size
    if spec.is_fp4:
        native = (1, spec.block)
        if shape not in (None, native):
            raise ValueError(f"{spec.name} blocks are fixed at {native}; drop block_shape={shape}")
        return PerBlock(native)
    shape = tuple(shape or ACT_BLOCK)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"block_shape must be two positive ints (rows, cols), got {shape}")
    return PerBlock(shape)
