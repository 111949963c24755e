"""Residual correction: RC(x) = Q(x) + Q(x - Q(x)) is strictly more accurate than Q(x)."""
import pytest
import torch

from qurl_mcore.quant import fake_quantize, quantize, residual_fake_quantize, residual_quantize

FMTS = ["int8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]


def _inputs():
    gauss = torch.randn(64, 512)
    outliers = torch.randn(64, 512)
    outliers[:, ::37] *= 50.0  # LLM-style outlier channels
    outliers[5, 100] = 400.0
    return {"gaussian": gauss, "outliers": outliers}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_residual_error_strictly_below_single_q(fmt, granularity, kind, record_property):
    x = _inputs()[kind]
    err_q = (fake_quantize(x, fmt, granularity) - x).norm()
    err_rc = (residual_fake_quantize(x, fmt, granularity) - x).norm()
    record_property("rc_gain", float(err_q / err_rc))
    assert err_rc < err_q
    # the second term quantizes exactly the residual with its own scales
    first, second = residual_quantize(x, fmt, granularity)
    assert torch.equal(second.dequantize(), quantize(x - first.dequantize(), fmt, granularity).dequantize())


def test_residual_of_an_exactly_representable_tensor_is_zero():
    x = torch.tensor([[0.5, -1.0, 6.0, 3.0] * 8])
    first, second = residual_quantize(x, "mxfp4", "block")
    assert torch.equal(first.dequantize(), x)
    assert torch.equal(second.dequantize(), torch.zeros_like(x))
    assert torch.equal(residual_fake_quantize(x, "mxfp4", "block"), x)


def test_fp4_gain_on_gaussian_is_large():
    """Closed-form expectation: the residual of a uniform-ish rounding error is re-quantized with a scale that is
    ~1/8..1/16 of the first, so RC shrinks the RMS error by roughly an order of magnitude."""
    x = torch.randn(256, 512)
    for fmt in ("nvfp4", "mxfp4"):
        gain = (fake_quantize(x, fmt, "block") - x).norm() / (residual_fake_quantize(x, fmt, "block") - x).norm()
        assert 4.0 < gain < 30.0, (fmt, gain)
