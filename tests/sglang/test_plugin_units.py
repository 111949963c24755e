"""The plugin's pieces without an engine: options, registration, master-weight bookkeeping."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from qurl_mcore.quant import make_spec, quantize_weight
from qurl_mcore.sglang import METHODS, QurlOptions, register
from qurl_mcore.sglang import weights
from tests.conftest import requires_cuda


def test_options_defaults_and_validation():
    assert QurlOptions.parse("qurl_int8").spec() == make_spec("naive", "int8")
    assert QurlOptions.parse("qurl_fp8").spec() == make_spec("naive", "fp8_e4m3")
    assert QurlOptions.parse("qurl_fp4").fmt == "nvfp4"
    rc = QurlOptions.parse("qurl_fp4_rc", {"quant_method": "qurl_fp4_rc", "fmt": "mxfp4", "scope": "experts",
                                           "packed_modules_mapping": {}, "hf_config": None})
    assert rc.spec() == make_spec("rc_forward", "mxfp4") and rc.scope == "experts"
    # default scopes come from the precision table: W8A8 everywhere, FP4 on the experts (MoEResQ)
    assert QurlOptions.parse("qurl_int8").scope == "all" and QurlOptions.parse("qurl_fp4_rc").scope == "experts"
    for bad in ({"fmt": "int4"}, {"scope": "attention"}, {"kernel": "cutlass"}, {"master": "disk"}, {"bits": 4},
                {"quant_method": "qurl_fp4"}):
        with pytest.raises(ValueError):
            QurlOptions.parse("qurl_fp4_rc", bad)
    with pytest.raises(ValueError, match="always uses int8"):
        QurlOptions.parse("qurl_int8", {"fmt": "fp8_e4m3"})
    assert QurlOptions.parse("qurl_fp4_rc", rc.override_args()["quantization_config"]) == rc


def test_registered_through_the_entry_point():
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS, QUANTIZATION_METHODS

    [ep] = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "qurl"]
    assert ep.load() is register
    register()
    for method in METHODS:
        assert QUANTIZATION_METHODS[method].method == method
        assert CPU_QUANTIZATION_METHODS[method] is QUANTIZATION_METHODS[method]
        assert method in QUANTIZATION_CHOICES


def test_master_detach_attach_keeps_the_parameter_and_its_loader():
    layer = torch.nn.Module()
    param = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
    param.weight_loader = "loader"
    layer.register_parameter("weight", param)
    weights.detach_master(layer, "weight", host=True)
    assert not weights.is_loaded(layer, "weight") and "weight" not in dict(layer.named_parameters())
    weights.attach_master(layer, "weight")
    assert layer.weight is param and layer.weight.weight_loader == "loader"
    weights.attach_master(layer, "weight")  # no-op when attached


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_store_rewrites_in_place(fmt):
    spec = make_spec("naive", fmt)
    old = quantize_weight(torch.randn(32, 64), spec)
    ptrs = (old.data.data_ptr(), old.scale.data_ptr())
    new = quantize_weight(torch.randn(32, 64), spec)
    kept = weights.store(old, new)
    assert kept is old and (old.data.data_ptr(), old.scale.data_ptr()) == ptrs
    assert torch.equal(kept.dequantize(), new.dequantize())
    assert weights.store(old, quantize_weight(torch.randn(16, 64), spec)) is not old  # other shape: replaced


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_a_host_master_is_written_where_it_waits_and_quantized_at_home(device):
    """The weight-update cycle with master="host": the Parameter goes back on the layer where it waits (pinned
    host memory; no full-precision copy on the device for the session), and the quantized copy is made at the
    layer's home from a copy of one weight. On the CPU home and host coincide."""
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.randn(32, 64, device=device), requires_grad=False))
    spec = make_spec("naive", "int8")
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
