"""The engine's host masters without SGLang (the GPU machine has none): a quantized layer's full-precision weight
waits in pinned host memory between pushes and is quantized at the layer's home, one weight at a time."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.quant import make_spec, quantize_weight
from qurl_mcore.sglang import weights
from tests.conftest import requires_cuda


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_a_host_master_is_written_where_it_waits_and_quantized_at_home(device):
    """The weight-update cycle with master="host": the Parameter goes back on the layer where it waits (pinned
    host memory; no full-precision copy on the device for the session), and the quantized copy is made at the
    layer's home from a copy of one weight. On the CPU home and host coincide."""
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.randn(32, 64, device=device), requires_grad=False))
    spec = make_spec("rc_none", "int8")
    assert weights.home(layer, "weight") == layer.weight.device
    weights.detach_master(layer, "weight", host=True)
    weights.attach_master(layer, "weight")
    assert layer.weight.device.type == "cpu" and (device == "cpu" or layer.weight.is_pinned())
    new = torch.randn(32, 64, device=device)
    layer.weight.data.copy_(new)  # what SGLang's loader does
    got = quantize_weight(weights.at_home(layer, "weight", layer.weight.data), spec)
    assert got.data.device == new.device
    assert torch.equal(got.dequantize(), quantize_weight(new, spec).dequantize())
    w = layer.weight.data
    assert (weights.at_home(layer, "weight", w).data_ptr() == w.data_ptr()) == (device == "cpu")  # no copy at home
