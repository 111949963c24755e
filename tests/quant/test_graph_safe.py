"""Graph-safe numerics: quantize/dequantize and residual quantization trace into one graph (no host
synchronisation, no data-dependent shapes), so a rollout engine can capture them in CUDA graphs and
torch.compile can fuse them; the compiled results equal eager bitwise."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.quant import quantize, residual_quantize

CASES = [("int8", "channel"), ("int8", "token"), ("int8", "tensor"), ("int8", "block"), ("fp8_e4m3", "token"),
         ("fp8_e4m3", "block"), ("fp8_e5m2", "channel"), ("nvfp4", "block"), ("mxfp4", "block")]


def _round_trip(fmt: str, granularity: str):
    return lambda x: quantize(x, fmt, granularity).dequantize()


def _residual(fmt: str, granularity: str):
    def rc(x):
        first, second = residual_quantize(x, fmt, granularity)
        return first.dequantize(torch.float32) + second.dequantize(torch.float32)

    return rc


@pytest.mark.parametrize("fmt,granularity", CASES)
@pytest.mark.parametrize("make", [_round_trip, _residual], ids=["quantize", "residual"])
def test_traces_as_one_graph(fmt, granularity, make):
    """fullgraph=True fails on any graph break (a .item(), a host read, a data-dependent shape)."""
    torch._dynamo.reset()
    x = torch.randn(64, 256) * 3
    compiled = torch.compile(make(fmt, granularity), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), make(fmt, granularity)(x))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,granularity", [("int8", "token"), ("fp8_e4m3", "channel"), ("nvfp4", "block"),
                                             ("mxfp4", "block")])
def test_fused_kernels_equal_eager_bitwise(fmt, granularity):
    """The inductor-generated (fused) kernels compute the same codes and scales as eager, bit for bit."""
    torch._dynamo.reset()
    x = torch.randn(128, 512) * 3
    fn = _round_trip(fmt, granularity)
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


def test_a_non_finite_input_still_raises_outside_a_graph():
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[1.0, float("nan")]]), "int8", "token")
