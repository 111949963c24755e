"""GEMM backends: the real int8/fp8 kernels (which torch also runs on CPU) agree with the emulated reference."""
import pytest
import torch

from qurl_mcore.quant import quantize, quantized_matmul, select_backend
from tests.conftest import requires_cuda


def _operands(fmt, m=32, n=48, k=64, device="cpu", a_gran="token", b_gran="channel"):
    a = quantize(torch.randn(m, k, device=device), fmt, a_gran)
    b = quantize(torch.randn(n, k, device=device), fmt, b_gran)
    return a, b


def test_int8_kernel_accumulates_exactly_then_scales():
    a, b = _operands("int8")
    out = quantized_matmul(a, b, backend="int8")
    exact_int = a.codes().to(torch.int64) @ b.codes().to(torch.int64).t()
    want = exact_int.to(torch.float64) * a.scale.double() * b.scale.double().t()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt,backend", [("int8", "int8"), ("fp8_e4m3", "fp8")])
@pytest.mark.parametrize("grans", [("token", "channel"), ("tensor", "tensor"), ("token", "tensor")])
def test_kernel_equals_emulated(fmt, backend, grans):
    a, b = _operands(fmt, a_gran=grans[0], b_gran=grans[1])
    torch.testing.assert_close(quantized_matmul(a, b, backend=backend),
                               quantized_matmul(a, b, backend="emulated"), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_int8_kernel_serves_decode_shapes_exactly(m):
    """A few tokens (decode) run the int8 kernel too, padded with zero rows, and equal the exact product."""
    a, b = _operands("int8", m=m)
    out = quantized_matmul(a, b, backend="int8")
    exact = (a.codes().long() @ b.codes().long().t()).double() * a.scale.double() * b.scale.double().t()
    assert out.shape == (m, 48)
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6)


def test_auto_is_emulated_on_cpu_and_kernels_refuse_what_they_cannot_run():
    a, b = _operands("int8")
    assert select_backend(a, b) == "emulated"
    fa, fb = _operands("nvfp4", a_gran="block", b_gran="block")
    assert select_backend(fa, fb) == "emulated"
    with pytest.raises(ValueError, match="cannot run nvfp4/block"):
        quantized_matmul(fa, fb, backend="fp8")
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        quantized_matmul(a, b, backend="tensorrt")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt,kernel", [("int8", "int8"), ("fp8_e4m3", "fp8")])
def test_cuda_auto_picks_the_kernel_and_matches_emulation(fmt, kernel):
    if fmt == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMM needs compute capability 8.9 or newer")
    a, b = _operands(fmt, m=64, n=128, k=256, device="cuda")
    assert select_backend(a, b) == kernel
    small, _ = _operands(fmt, m=1, n=128, k=256, device="cuda")
    assert select_backend(small, b) == kernel  # decode shapes take the kernel too
    torch.testing.assert_close(quantized_matmul(a, b), quantized_matmul(a, b, backend="emulated"),
                               rtol=1e-3, atol=1e-2)
