"""Graph-safe numerics: quantize/dequantize and residual quantization trace into one graph (no host
synchronisation, no data-dependent shapes), so a rollout engine can capture them in CUDA graphs and
torch.compile can fuse them; the compiled results equal eager bitwise."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.quant import quantize, residual_quantize

CASES = [("int8", "channel"), ("int8", "token"), ("int8", "tensor"), ("int8", "block"), ("fp8_e4m3", "token"),
         ("fp8_e4m3", "block"), ("fp8_e5m2", "channel"), ("nvfp4", "block"), ("mxfp4", "block"), ("hif4", "block")]


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
                                             ("mxfp4", "block"), ("hif4", "block")])
def test_fused_kernels_equal_eager_bitwise(fmt, granularity):
    """The inductor-generated (fused) kernels compute the same codes and scales as eager, bit for bit."""
    torch._dynamo.reset()
    x = torch.randn(128, 512) * 3
    fn = _round_trip(fmt, granularity)
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


def test_a_non_finite_input_still_raises_outside_a_graph():
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[1.0, float("nan")]]), "int8", "token")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.slow
@pytest.mark.parametrize("method,fmt", [("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"),
                                        ("qurl_fp4", "mxfp4"), ("qurl_fp4", "hif4")])
def test_compiled_weight_quantizer_equals_eager_bitwise_in_one_graph(method, fmt):
    """An engine's `requant: compiled` quantizer: the same codes, scales and global scale as `quantize_weight`,
    for BF16 weights of several shapes and an expert's slice of a stacked tensor, from one graph (dynamic
    shapes: a model's many weight shapes must not recompile it per shape). The shapes hold two or more whole
    blocks a row (HiF4's 64-element units too): a partial block or a single one is a shape of its own to the
    compiler, as sizes 0 and 1 are."""
    from torch._dynamo.utils import counters

    from qurl_mcore.quant import quantize_weight, quantize_weight_compiled
    from qurl_mcore.recipe import engine_recipe

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    spec = engine_recipe(method, fmt).spec
    experts = torch.randn(3, 96, 128, dtype=torch.bfloat16)
    for w in (torch.randn(64, 128, dtype=torch.bfloat16) * 5, torch.randn(160, 192, dtype=torch.bfloat16), experts[1]):
        got, want = quantize_weight_compiled(w, spec), quantize_weight(w, spec)
        assert (got.fmt, got.granularity, got.shape, got.dtype) == (want.fmt, want.granularity, want.shape, want.dtype)
        assert torch.equal(_bits(got.data), _bits(want.data)) and torch.equal(_bits(got.scale), _bits(want.scale))
        assert (got.global_scale is None) == (want.global_scale is None)
        assert got.global_scale is None or torch.equal(got.global_scale, want.global_scale)
    assert counters["stats"]["unique_graphs"] - graphs == 1
