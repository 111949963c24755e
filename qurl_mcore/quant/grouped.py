"""Grouped GEMMs over rows sorted by group (an MoE layer's tokens permuted by expert), for `quant_linear` on
stacked expert weights.

With the rows of group g at [o_{g-1}, o_g) (o the cumulative ends, `Groups.offs`):
  forward      Y[o_{g-1}:o_g]  = A[o_{g-1}:o_g] · B_g                  A [T, K], B [G, K, N]  -> [T, N]
  weight grad  W_g             = A[:, o_{g-1}:o_g] · B[o_{g-1}:o_g]     A [K, T], B [T, N]     -> [G, K, N]
One call, `torch._grouped_mm`, where the device has the kernel for the operands (`grouped_kernel`); elsewhere a
loop over the groups, which needs their sizes on the host (read once per `Groups`, and free when the sizes come
from the host, as Megatron's token dispatchers give them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: torch._grouped_mm's CUDA kernel (CUTLASS): bf16 operands on compute capability >= 9 (H100, H200, B200)
GROUPED_MM_CUDA = (9, torch.bfloat16)
#: dtypes of torch._grouped_mm's CPU implementation (torch >= 2.10)
GROUPED_MM_CPU = (torch.float32, torch.bfloat16)


@dataclass
class Groups:
    """Row groups of a grouped GEMM: `offs` the int32 cumulative ends on the operands' device; `sizes` the
    per-group row counts on the host, read from `offs` only when a loop needs them."""

    offs: torch.Tensor
    _sizes: list[int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, counts: torch.Tensor, device: torch.device) -> "Groups":
        """The groups of `counts` rows each (a [G] integer tensor on any device)."""
        sizes = counts.tolist() if counts.device.type == "cpu" else None  # host values: no device read
        return cls(counts.to(device=device, dtype=torch.int64).cumsum(0).to(torch.int32), sizes)

    @property
    def sizes(self) -> list[int]:
        if self._sizes is None:
            ends = self.offs.tolist()  # one read back, cached for the backward's GEMMs
            self._sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
        return self._sizes


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout constraint: 16-byte aligned data and strides (other than the unit one)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or s * size % 16 == 0 for s in t.stride())


def grouped_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs a · b here: one dtype its kernel takes on this device (`GROUPED_MM_CUDA`,
    `GROUPED_MM_CPU`), with the layout it needs."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if a.device.type == "cuda":
        major, dtype = GROUPED_MM_CUDA
        supported = torch.cuda.get_device_capability(a.device)[0] >= major and a.dtype == dtype
    else:
        supported = a.device.type == "cpu" and a.dtype in GROUPED_MM_CPU
    return supported and _aligned(a) and _aligned(b)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The grouped product of the module docstring: a 2-D `a` [T, K] with a 3-D `b` [G, K, N] gives [T, N]; a
    2-D `a` [K, T] with a 2-D `b` [T, N] gives [G, K, N] (an empty group: zeros)."""
    if grouped_kernel(a, b):
        return torch._grouped_mm(a, b, offs=groups.offs)
    if b.dim() == 3:
        return torch.cat([x @ w for x, w in zip(a.split(groups.sizes), b.unbind())])
    return torch.stack([x @ y for x, y in zip(a.split(groups.sizes, dim=1), b.split(groups.sizes))])
