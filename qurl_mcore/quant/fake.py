"""Fake quantization with a straight-through estimator, single (Q) and residual-corrected (RC).

  fake_quantize(x)          = Q(x)                      = dequantize(quantize(x))
  residual_fake_quantize(x) = RC(x) = Q(x) + Q(x - Q(x))   (MoEResQ Eq. 1: the residual gets its own scales)
Both pass gradients straight through: d out / d x = I.
"""
from __future__ import annotations

from typing import Callable

import torch

from .granularity import Granularity
from .qtensor import QTensor, quantize


def residual_quantize(
    x: torch.Tensor, fmt: str, granularity: Granularity | str, *, block_shape: tuple[int, int] | None = None,
    batch_dims: int = 0,
) -> tuple[QTensor, QTensor]:
    """(Q(x), Q(x - Q(x))): the two operands of a residual-corrected GEMM (`batch_dims` as in `quantize`)."""
    first = quantize(x, fmt, granularity, block_shape=block_shape, batch_dims=batch_dims)
    residual = x.detach().to(torch.float32) - first.dequantize(torch.float32)
    return first, quantize(residual, fmt, granularity, block_shape=block_shape, batch_dims=batch_dims)


def _q(x: torch.Tensor, fmt: str, granularity: Granularity | str, block_shape) -> torch.Tensor:
    return quantize(x, fmt, granularity, block_shape=block_shape).dequantize()


def _rc(x: torch.Tensor, fmt: str, granularity: Granularity | str, block_shape) -> torch.Tensor:
    first, second = residual_quantize(x, fmt, granularity, block_shape=block_shape)
    return (first.dequantize(torch.float32) + second.dequantize(torch.float32)).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantize(
    x: torch.Tensor, fmt: str, granularity: Granularity | str, *, block_shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """Q(x) in x's dtype, with identity gradient."""
    return _StraightThrough.apply(x, lambda t: _q(t, fmt, granularity, block_shape))


def residual_fake_quantize(
    x: torch.Tensor, fmt: str, granularity: Granularity | str, *, block_shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """RC(x) = Q(x) + Q(x - Q(x)) in x's dtype (the sum is formed in fp32), with identity gradient."""
    return _StraightThrough.apply(x, lambda t: _rc(t, fmt, granularity, block_shape))
