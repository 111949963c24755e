"""The FP4 Triton kernels (qurl_mcore.kernels) on the CPU through Triton's interpreter, against their
references: `experts_forward` and `quantized_linear`. Run by tests/kernels/test_fp4_kernels.py in a process
with `TRITON_INTERPRET=1` (tests/kernels/interpreter.py); skipped in any other.

Agreement bound. Both sides quantize the same codes and scales (the kernel's in-register quantization follows
`quantize` bit for bit), so they compute the same sums of exact products in fp32, in different orders and with
the scales applied at different points: per output, |kernel − reference| <= c·n·2^-24·M, with n the terms of
the sums (K of each GEMM) and M the sum of the terms' magnitudes (`_magnitude`), the classic bound of n-term
fp32 summation (c = 8 covers the scale products, SiLU and the routing-weighted sum). Outputs rounded to bf16
add one bf16 rounding of the result and of each intermediate (h, SiLU, the product), 2^-8 relative each.
This holds where no value lies within that distance of an FP4 rounding boundary (a code flipped by sum order
would show as a whole FP4 step): the seeds here have none. The MXFP4 variant by `tl.dot_scaled` (`scaled`,
Blackwell's) meets the same bound: the interpreter multiplies its E2M1 codes by their E8M0 scales in fp32
(exact: 2 significant bits times a power of two) and sums their products (exact: 4 significant bits) in
fp32, as a GPU's block-scaled MMA does."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qurl_mcore.kernels import fp4_gemm
from qurl_mcore.quant.experts import experts_forward
from qurl_mcore.quant.linear import make_spec, quantize_activation, quantize_weight, quantized_linear
from qurl_mcore.quant.qtensor import quantize
from qurl_mcore.sglang.weights import stack

from .interpreter import corrected_bf16, uncorrected

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="needs Triton's interpreter from the process start: test_fp4_kernels.py runs it"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),  # SiLU of a large negative gate
]

U = 2.0**-24
FORMATS = ("nvfp4", "mxfp4")
#: (format, by tl.dot_scaled): every format by decoded bf16 MMAs, and MXFP4 by dot_scaled as on Blackwell
DOTS = (("nvfp4", False), ("mxfp4", False), ("mxfp4", True))
MODES = ("rc_none", "rc_forward")
E, H, I = 8, 96, 48  # H, I: whole and partial tiles and (MXFP4, I) a partial block
#: the expert ids tokens are routed to: expert 3 none (empty), -2, -1, 8, 9 another EP rank's (outside [0, E))
POOL = torch.tensor([-2, -1, 0, 1, 2, 4, 5, 6, 7, 8, 9])


@pytest.fixture(scope="module")
def fp4_moe():
    with corrected_bf16():
        from qurl_mcore.kernels import fp4_moe

        yield fp4_moe


@triton.jit
def bf16_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """C [M, N] fp32 = A [M, K] · B [K, N], both bf16, row-major: the product the FP4 kernels' MMAs compute."""
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, out_dtype=tl.float32))


@triton.jit
def pack_mxfp4(x_ptr, codes_ptr, scales_ptr, q_ptr, M: tl.constexpr, K: tl.constexpr):
    """The dot_scaled operands of x [M, K] fp32 (`fp4_gemm._packed_tile`): codes [M, K/2], E8M0 bytes
    [M, K/32], and Q(x) [M, K]."""
    m, k = tl.arange(0, M), tl.arange(0, K)
    codes, scales, q = fp4_gemm._packed_tile(tl.load(x_ptr + m[:, None] * K + k[None, :]), M, K, 32)
    tl.store(codes_ptr + m[:, None] * (K // 2) + tl.arange(0, K // 2)[None, :], codes)
    tl.store(scales_ptr + m[:, None] * (K // 32) + tl.arange(0, K // 32)[None, :], scales)
    tl.store(q_ptr + m[:, None] * K + k[None, :], q)


@triton.jit
def to_bf16(x_ptr, y_ptr, N: tl.constexpr):
    """y = x.to(bf16) for fp32 x: the rounding the kernels apply where the emulation rounds to bf16."""
    n = tl.arange(0, N)
    tl.store(y_ptr + n, tl.load(x_ptr + n).to(tl.bfloat16))


def _routing(tokens: int, k: int, g: torch.Generator):
    ids = torch.stack([POOL[torch.randperm(len(POOL), generator=g)[:k]] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=g), ids


def _activations(tokens: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random tokens, the first all zeros, the second with one block 10^4 larger than the rest (NVFP4: block
    scales of the others underflow E4M3 to subnormals and zeros)."""
    x = torch.randn(tokens, H, generator=g)
    x[0] = 0
    x[1, :16] *= 1e4
    return x.to(dtype)


def _experts(spec, g: torch.Generator):
    w13, _ = stack([quantize_weight(torch.randn(2 * I, H, generator=g) / H**0.5, spec) for _ in range(E)])
    w2, _ = stack([quantize_weight(torch.randn(H, I, generator=g) / I**0.5, spec) for _ in range(E)])
    return w13, w2


def _magnitude(x, p, ids, w13, w2, spec) -> torch.Tensor:
    """M[t, :] = Σ_j |p_tj|·(|Q̃(h_tj)|·|Q(W2_e)|ᵀ), h_tj the reference's hidden activation for slot (t, j):
    the magnitude of the terms each output sums."""
    w13f, w2f = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    xq = quantize_activation(x, spec)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t, j in zip(*torch.where((ids >= 0) & (ids < w13.shape[0]))):
        e = ids[t, j]
        gate, up = (xq[t].float() @ w13f[e].t()).to(x.dtype).chunk(2)
        hidden = quantize_activation((F.silu(gate) * up)[None], spec)[0].float()
        out[t] += p[t, j].abs() * (hidden.abs() @ w2f[e].abs().t())
    return out


def test_the_interpreter_multiplies_bf16_tiles_exactly_with_the_correction(fp4_moe):
    """The dot's correction is in force for the kernels' tests (a bf16 dot gives the exact product of small
    integers) and needed (the interpreter's own bf16 dot does not)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-8, 9, (16, 32), generator=g).to(torch.bfloat16)
    b = torch.randint(-8, 9, (32, 16), generator=g).to(torch.bfloat16)
    exact = a.float() @ b.float()  # integers below 2^24: exact in any order
    c = torch.empty(16, 16)
    bf16_dot[(1,)](a, b, c, 16, 16, 32)
    assert torch.equal(c, exact)
    with uncorrected():
        bf16_dot[(1,)](a, b, c, 16, 16, 32)
    assert not torch.equal(c, exact)


def test_the_interpreter_rounds_to_bf16_as_torch_with_the_correction(fp4_moe):
    """The cast's correction is in force (fp32 -> bf16 equals torch's round to nearest even, ties included)
    and needed (the interpreter's own cast truncates)."""
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(120, generator=g) * 100, torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(2 - 2.0**-9)]),
                   torch.tensor([0.0, 2.0**-130, 3e38, -7.0, 1.0])])
    y = torch.empty(128, dtype=torch.bfloat16)
    to_bf16[(1,)](x, y, 128)
    assert torch.equal(y, x.to(torch.bfloat16))
    with uncorrected():
        to_bf16[(1,)](x, y, 128)
    assert not torch.equal(y, x.to(torch.bfloat16))


def test_activation_tiles_pack_to_quantize_s_mxfp4_codes_and_scales_bit_for_bit(fp4_moe):
    """The dot_scaled operands of a tile (Blackwell's MXFP4 variant) are `quantize`'s codes (two a byte, low
    nibble first) and E8M0 bytes, for X and for RC's residual X − Q(X): random rows, a zero row, exact ties
    of every binade, a tiny and a huge block."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 64, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    x[0] = 0
    x[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 8) * torch.tensor([1.0, -1.0]).repeat(32)
    x[2, :32] *= 2.0**-120
    x[3, 32:] *= 2.0**100
    for part in range(2):  # X, then the residual X − Q(X) of its Q
        codes, scales = torch.empty(16, 32, dtype=torch.uint8), torch.empty(16, 2, dtype=torch.uint8)
        q = torch.empty(16, 64)
        pack_mxfp4[(1,)](x, codes, scales, q, 16, 64)
        ref = quantize(x, "mxfp4", "block", batch_dims=1)
        assert torch.equal(codes, ref.data) and torch.equal(scales, ref.scale.view(torch.uint8).reshape(16, 2))
        assert torch.equal(q, ref.dequantize(torch.float32))
        assert part or (codes >> 4).unique().numel() == 16  # every code, both nibbles
        x = x - q


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt, scaled", DOTS)
def test_experts_equal_the_emulation_up_to_fp32_sum_order(fp4_moe, fmt, scaled, mode, k):
    """Every FP4 format (MXFP4 also by tl.dot_scaled), RC off and on, top-k 1/2/8, ids outside the rank's
    experts, an empty expert, routed blocks with padding rows, a zero token and underflowing NVFP4 block
    scales: within the fp32 bound."""
    spec = make_spec(mode, fmt)
    g = torch.Generator().manual_seed(k)
    w13, w2 = _experts(spec, g)
    x = _activations(5, torch.float32, g)
    p, ids = _routing(5, k, g)
    out = fp4_moe.fp4_experts(x, p, ids, w13, w2, spec, scaled=scaled)
    ref = experts_forward(x, p, ids, w13, w2, spec)
    bound = 8 * (H + I) * U * _magnitude(x, p, ids, w13, w2, spec)
    assert (ref != 0).any() and ref.dtype == out.dtype
    assert ((out - ref).abs() <= bound).all(), f"max error {(out - ref).abs().max():.3g}, bound {bound.max():.3g}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_experts_round_as_the_emulation_rounds(fp4_moe, fmt, mode):
    """bf16 activations: h, SiLU, the product and the output rounded to bf16 where the emulation rounds them,
    so the two differ by the fp32 bound and a bf16 rounding of each intermediate."""
    spec = make_spec(mode, fmt)
    g = torch.Generator().manual_seed(7)
    w13, w2 = _experts(spec, g)
    x = _activations(6, torch.bfloat16, g)
    p, ids = _routing(6, 2, g)
    out = fp4_moe.fp4_experts(x, p, ids, w13, w2, spec)
    ref = experts_forward(x, p, ids, w13, w2, spec)
    bound = (8 * (H + I) * U + 4 * 2.0**-8) * _magnitude(x, p, ids, w13, w2, spec)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs() <= bound).all()


@pytest.mark.parametrize("fmt, scaled", DOTS)
def test_experts_never_compute_an_unrouted_expert(fp4_moe, fmt, scaled):
    """Experts no token is routed to get non-finite scales (NVFP4: its tensor scale NaN; MXFP4: E8M0 byte 255,
    inf): a kernel that multiplied them, even by zero rows as the emulation does, would make NaN (the
    emulation stops on it at the second GEMM's quantization). The kernel returns what it returns with their
    real weights, bit for bit."""
    spec = make_spec("rc_forward", fmt)
    g = torch.Generator().manual_seed(3)
    w13, w2 = _experts(spec, g)
    x = _activations(4, torch.float32, g)
    p, ids = _routing(4, 2, g)
    clean = fp4_moe.fp4_experts(x, p, ids, w13, w2, spec, scaled=scaled)
    unrouted = [e for e in range(E) if not (ids == e).any()]
    assert 3 in unrouted
    for w in (w13, w2):
        if fmt == "nvfp4":
            w.global_scale[unrouted] = float("nan")
        else:
            w.scale[unrouted] = 255
    with pytest.raises(ValueError, match="non-finite"):  # computing every expert meets the poison
        experts_forward(x, p, ids, w13, w2, spec)
    assert torch.equal(fp4_moe.fp4_experts(x, p, ids, w13, w2, spec, scaled=scaled), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt, scaled", DOTS)
def test_linear_equals_quantized_linear_up_to_fp32_sum_order(fp4_moe, fmt, scaled, mode, dtype):
    """The dense FP4 linear (one expert, every row routed), with a bias, on a [2, 3, H] input and 80 outputs
    (a partial tile): within the fp32 bound, plus one bf16 rounding of the output for bf16."""
    spec = make_spec(mode, fmt)
    g = torch.Generator().manual_seed(11)
    wq = quantize_weight(torch.randn(80, H, generator=g), spec)
    bias = torch.randn(80, generator=g).to(dtype)
    x = _activations(6, dtype, g).reshape(2, 3, H)
    out = fp4_moe.fp4_linear(x, wq, bias, spec, scaled=scaled)
    ref = quantized_linear(x, wq, bias, spec)
    magnitude = quantize_activation(x, spec).float().abs() @ wq.dequantize(torch.float32).abs().t()
    bound = 8 * H * U * magnitude + (0 if dtype == torch.float32 else 2.0**-8 * ref.float().abs())
    assert out.shape == ref.shape == (2, 3, 80) and out.dtype == dtype
    assert ((out.float() - ref.float()).abs() <= bound).all()
