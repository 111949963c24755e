"""The quantized linear autograd function against its defining formulas, written out by hand with the public
fake-quantization functions."""
import pytest
import torch

from qurl_mcore.quant import (
    PerBlock, PerRow, PerToken, fake_quantize, make_spec, quant_linear, quantize_activation, quantize_weight,
    quantized_linear, residual_fake_quantize,
)


def test_gradcheck_float64_with_quantization_off():
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    spec = make_spec("bf16")
    assert torch.autograd.gradcheck(lambda *a: quant_linear(*a, spec=spec), (x, w, b))


def test_bf16_mode_is_plain_linear_bitwise():
    x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(quant_linear(x, w, b, spec=make_spec("bf16")), torch.nn.functional.linear(x, w, b))


def _reference(x, w, b, g, mode, fmt):
    """Y, dX, dW, db from the formulas, using fake_quantize (Q) and residual_fake_quantize (RC)."""
    gran = "block" if fmt in ("nvfp4", "mxfp4", "hif4") else "token"
    wgran = "block" if fmt in ("nvfp4", "mxfp4", "hif4") else "channel"
    # activations and gradients token by token: each row quantized as a tensor of its own
    q = lambda t: torch.cat([fake_quantize(row[None], fmt, gran) for row in t])  # noqa: E731
    rc = lambda t: torch.cat([residual_fake_quantize(row[None], fmt, gran) for row in t])  # noqa: E731
    fwd = rc if mode in ("rc_forward", "rc_both") else q
    bwd = rc if mode in ("rc_backward", "rc_both") else q
    wq = fake_quantize(w, fmt, wgran)
    y = fwd(x) @ wq.t() + b
    gq = bwd(g)
    return y, gq @ wq, gq.t() @ bwd(x), g.sum(0)


@pytest.mark.parametrize("mode", ["rc_none", "rc_forward", "rc_backward", "rc_both"])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "nvfp4", "mxfp4", "hif4"])
def test_forward_and_backward_follow_the_formulas(mode, fmt):
    x = torch.randn(24, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    g = torch.randn(24, 32)
    y = quant_linear(x, w, b, spec=make_spec(mode, fmt, backend="emulated"))
    y.backward(g)
    ry, rdx, rdw, rdb = _reference(x.detach(), w.detach(), b.detach(), g, mode, fmt)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.detach(), ry, **tol)
    torch.testing.assert_close(x.grad, rdx, **tol)
    torch.testing.assert_close(w.grad, rdw, **tol)
    torch.testing.assert_close(b.grad, rdb)


@pytest.mark.parametrize("mode", ["rc_none", "rc_both"])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "nvfp4", "mxfp4", "hif4"])
def test_a_tokens_output_does_not_depend_on_the_batch_beside_it(mode, fmt):
    """The trainer runs a token in a micro-batch of whole sequences, the engine in a prefill or a one-token
    decode batch: the token's quantized activation must be the same bitwise, and so its output, in training
    and in inference, up to the GEMM's summation order (which BLAS may choose by batch size). A token 1000x
    larger beside the others would move any per-batch scale by far more."""
    spec = make_spec(mode, fmt, backend="emulated")
    w = torch.randn(32, 64)
    tokens = torch.randn(6, 64)
    batch = torch.cat([tokens, 1000 * torch.randn(1, 64)])
    alone = torch.cat([quantize_activation(t[None], spec) for t in tokens])
    assert torch.equal(quantize_activation(batch, spec)[:6], alone)
    wq = quantize_weight(w, spec)
    outputs = torch.cat([quantized_linear(t[None], wq, None, spec) for t in tokens])
    torch.testing.assert_close(quantized_linear(batch, wq, None, spec)[:6], outputs, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(quant_linear(batch, w, spec=spec)[:6], outputs, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("mode", ["rc_none", "rc_both"])
@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_no_tokens_give_an_empty_output_and_a_zero_weight_gradient(mode, fmt):
    """An MoE expert that no token of a micro-batch was routed to still runs (Megatron's SequentialMLP calls
    every local expert): Y is [0, out] and dW = 0, as for the plain linear. (Found by the MoE study: an FP4
    run stopped at step 5 with "cannot quantize an empty tensor of shape (0, 128)".)"""
    spec = make_spec(mode, fmt, backend="emulated")
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    y = quant_linear(x, w, b, spec=spec)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    assert x.grad.shape == (0, 64)
    served = quantized_linear(torch.randn(2, 0, 64), quantize_weight(w.detach(), spec), b.detach(), spec)
    assert served.shape == (2, 0, 32) and served.dtype == torch.float32


def test_modes_differ_where_they_should():
    x, w, g = torch.randn(16, 64), torch.randn(8, 64), torch.randn(16, 8)
    outs = {}
    for mode in ("rc_none", "rc_forward", "rc_backward", "rc_both"):
        xx = x.clone().requires_grad_()
        y = quant_linear(xx, w, spec=make_spec(mode, "nvfp4"))
        y.backward(g)
        outs[mode] = (y.detach(), xx.grad)
    assert torch.equal(outs["rc_none"][0], outs["rc_backward"][0])  # same forward
    assert torch.equal(outs["rc_forward"][0], outs["rc_both"][0])
    assert not torch.equal(outs["rc_none"][0], outs["rc_both"][0])
    assert torch.equal(outs["rc_none"][1], outs["rc_forward"][1])  # same backward
    assert not torch.equal(outs["rc_none"][1], outs["rc_both"][1])


def test_rc_forward_removes_most_of_the_activation_error():
    """RC corrects the activation operand only; against X·Q(W)ᵀ its error is several times smaller."""
    x, w = torch.randn(64, 256), torch.randn(128, 256)
    x[:, ::17] *= 30
    exact = x @ fake_quantize(w, "nvfp4", "block").t()
    err = {m: (quant_linear(x, w, spec=make_spec(m, "nvfp4")) - exact).norm() for m in ("rc_none", "rc_both")}
    assert err["rc_both"] < 0.25 * err["rc_none"]


def test_inference_path_equals_training_forward():
    """The rollout engine (quantized once, then `quantized_linear`) computes what the trainer's forward does."""
    x, w, b = torch.randn(2, 9, 64, dtype=torch.bfloat16), torch.randn(48, 64), torch.randn(48)
    for fmt, mode in (("int8", "rc_none"), ("fp8_e4m3", "rc_none"), ("nvfp4", "rc_both"), ("mxfp4", "rc_forward")):
        spec = make_spec(mode, fmt)
        inference = quantized_linear(x, quantize_weight(w, spec), b, spec)
        assert inference.shape == (2, 9, 48) and inference.dtype == torch.bfloat16
        assert torch.equal(inference, quant_linear(x, w, b, spec=spec))


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown quantized-linear mode 'rc'"):
        make_spec("rc", "nvfp4")
    with pytest.raises(ValueError, match="needs a format"):
        make_spec("rc_none")
    with pytest.raises(ValueError, match="drop fmt"):
        make_spec("bf16", "int8")
    with pytest.raises(ValueError, match="not a granularity"):
        make_spec("rc_none", "int8", act_granularity="row")
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        make_spec("rc_none", "int8", backend="cutlass")
    s = make_spec("rc_both", "mxfp4")
    assert (s.weight_granularity, s.act_granularity, s.grad_granularity) == (PerBlock((1, 32)),) * 3
    s = make_spec("rc_none", "int8")
    assert (s.weight_granularity, s.act_granularity) == (PerRow(), PerToken())
    assert make_spec("rc_none", "int8", weight_granularity="block") == \
        make_spec("rc_none", "int8", weight_granularity=PerBlock((1, 128)))


@pytest.mark.parametrize("mode,fmt", [("rc_both", "nvfp4"), ("rc_none", "int8"), ("rc_forward", "fp8_e4m3")])
def test_training_gemm_reads_nothing_back_to_the_host(mode, fmt):
    """QuantLinearFunction's forward and backward quantize W, X and dY with no value read back to the host (no
    per-call GPU synchronization: tests/host_syncs.py)."""
    from tests.host_syncs import HostReads

    x = torch.randn(6, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with HostReads() as reads:
        quant_linear(x, w, spec=make_spec(mode, fmt)).square().sum().backward()
    assert reads.count == 0, reads.ops
    assert x.grad.isfinite().all() and w.grad.isfinite().all()
