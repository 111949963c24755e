"""QTensor storage, granularities, shapes and input validation."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qurl_mcore.quant import WEIGHT_BLOCK, fake_quantize, quantize, residual_fake_quantize
from qurl_mcore.quant.formats import FORMATS, quotient, quotient_fp64

FMTS = ["int8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]


@pytest.mark.parametrize("fmt,dtype", [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn),
                                       ("fp8_e5m2", torch.float8_e5m2), ("nvfp4", torch.uint8),
                                       ("mxfp4", torch.uint8)])
def test_storage_is_real_low_bit(fmt, dtype):
    q = quantize(torch.randn(8, 72), fmt, "block")  # partial blocks: padding is not stored
    assert q.data.dtype == dtype
    bits = 4 if fmt in ("nvfp4", "mxfp4") else 8
    assert q.data.numel() * q.data.element_size() * 8 == 8 * 72 * bits


def test_granularity_scale_shapes():
    w = torch.randn(256, 384)
    assert quantize(w, "int8", "tensor").scale.numel() == 1
    assert quantize(w, "int8", "channel").scale.shape == (256, 1)
    assert quantize(w, "int8", "token").scale.shape == (256, 1)
    assert quantize(w, "fp8_e4m3", "block").scale.shape == (256, 3, 1)  # 1x128 activation blocks
    assert quantize(w, "fp8_e4m3", "block", block_shape=WEIGHT_BLOCK).scale.shape == (2, 3, 1)
    assert quantize(w, "nvfp4", "block").scale.shape == (256, 24, 1)
    assert quantize(w, "mxfp4", "block").scale.shape == (256, 12, 1)


def test_weight_block_scale_is_tile_amax():
    w = torch.randn(256, 256)
    w[130, 7] = 99.0
    q = quantize(w, "fp8_e4m3", "block", block_shape=(128, 128))
    assert q.scale[1, 0, 0] == 99.0 / 448
    assert q.scale[0, 0, 0] == w[:128, :128].abs().max() / 448


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 70), lead=st.integers(1, 3),
       fmt=st.sampled_from(FMTS), gran=st.sampled_from(["tensor", "channel", "token", "block"]),
       big_block=st.booleans())
def test_any_shape_round_trips_to_its_shape(rows, cols, lead, fmt, gran, big_block):
    x = torch.randn(lead, rows, cols)
    block = (16, 32) if big_block and gran == "block" and fmt in ("int8", "fp8_e4m3", "fp8_e5m2") else None
    q = quantize(x, fmt, gran, block_shape=block)
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == x.dtype
    # idempotence: re-quantizing a dequantized tensor changes nothing for power-of-two-scaled formats
    if fmt == "mxfp4":
        assert torch.equal(quantize(out, fmt, gran).dequantize(), out)


def test_exactly_representable_values_survive():
    x = torch.arange(-127, 128, dtype=torch.float32).reshape(1, -1)
    assert torch.equal(quantize(x, "int8", "token").dequantize(), x)
    grid = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0] * 2])
    assert torch.equal(quantize(grid, "mxfp4", "block").dequantize(), grid)


def test_keeps_dtype_of_bf16_input():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert quantize(x, "nvfp4", "block").dequantize().dtype == torch.bfloat16
    assert fake_quantize(x, "int8", "token").dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_clear_error(bad):
    x = torch.randn(4, 16)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "int8", "token")


def test_bad_arguments_name_the_fix():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="unknown quantization format 'fp3'.*int8"):
        quantize(x, "fp3", "token")
    with pytest.raises(ValueError, match="unknown granularity 'row'"):
        quantize(x, "int8", "row")
    with pytest.raises(ValueError, match="fixed at"):
        quantize(x, "nvfp4", "block", block_shape=(1, 32))
    with pytest.raises(ValueError, match="only applies"):
        quantize(x, "int8", "token", block_shape=(1, 16))
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, 4, dtype=torch.int32), "int8", "token")
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.ones(0, 4), "int8", "token")


@pytest.mark.parametrize("fn", [fake_quantize, residual_fake_quantize])
@pytest.mark.parametrize("fmt", FMTS)
def test_straight_through_gradient_is_identity(fn, fmt):
    x = torch.randn(6, 64, requires_grad=True)
    g = torch.randn(6, 64)
    fn(x, fmt, "block").backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("fmt,gran", [("nvfp4", "block"), ("mxfp4", "block"), ("int8", "token"),
                                      ("fp8_e4m3", "token")])
def test_a_batch_of_tensors_quantizes_as_each_alone(fmt, gran):
    """batch_dims=1: x[i] are separate tensors; NVFP4 gives each its own per-tensor scale (here 1, 30 and 0.01
    times apart, so one shared scale would change the codes), and a zero tensor stays zero."""
    x = torch.stack([torch.randn(5, 64), 30 * torch.randn(5, 64), 0.01 * torch.randn(5, 64), torch.zeros(5, 64)])
    batch = quantize(x, fmt, gran, batch_dims=1)
    alone = [quantize(t, fmt, gran) for t in x]
    assert torch.equal(batch.dequantize(), torch.stack([q.dequantize() for q in alone]))
    if fmt == "nvfp4":
        assert torch.equal(batch.global_scale, torch.stack([q.global_scale for q in alone]))
        assert not torch.equal(quantize(x, fmt, gran).dequantize(), batch.dequantize())
    assert torch.equal(batch.dequantize()[3], torch.zeros(5, 64))


def test_a_batch_needs_groups_of_one_row():
    for gran, block in (("tensor", None), ("block", (128, 128))):
        with pytest.raises(ValueError, match="batch_dims=1 needs groups of one row"):
            quantize(torch.randn(2, 128, 128), "int8", gran, block_shape=block, batch_dims=1)
    with pytest.raises(ValueError, match="batch_dims=2"):
        quantize(torch.randn(2, 4, 16), "nvfp4", "block", batch_dims=2)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_row_whose_scale_underflows_encodes_zeros(fmt):
    """amax / max_fmt below fp32's smallest subnormal gives a zero scale: the row's codes and values are zero
    (no NaN from 0/0), and the other rows are untouched."""
    x = torch.tensor([[1e-44, -1e-44, 0.0, 0.0], [1.0, -2.0, 3.0, 0.5]])
    q = quantize(x, fmt, "channel")
    assert float(q.scale[0]) == 0.0
    assert torch.equal(q.codes()[0].to(torch.float32), torch.zeros(4))
    assert torch.equal(q.dequantize()[0], torch.zeros(4))
    assert torch.equal(q.dequantize()[1:], quantize(x[1:], fmt, "channel").dequantize())


def test_fp64_quotient_is_fp32_division_bitwise():
    """The compiled GPU path's quotient (fp64, rounded once) equals fp32 division on every format's scale
    divisor, also as inductor forms it there (times the divisor's fp64 reciprocal), and on tensor divisors,
    over values across 60 binades and at fp32's extremes of mantissa."""
    g = torch.Generator().manual_seed(0)
    mantissa = torch.cat([torch.rand(200_000, generator=g) + 1.0, torch.tensor([1.0, 1.0 + 2**-23, 2.0 - 2**-23])])
    a = mantissa * torch.exp2(torch.randint(-30, 30, mantissa.shape, generator=g).float())
    divisors = {spec.max_value for spec in FORMATS.values()} | {6.0 * 448.0}
    for d in divisors:
        exact = a / d
        assert torch.equal(quotient_fp64(a, d), exact), d
        assert torch.equal((a.double() * (1.0 / d)).float(), exact), d
    assert not torch.equal(a * (1.0 / 127.0), a / 127.0)  # what the fp32 reciprocal would have given
    b = (torch.rand(a.shape, generator=g) + 1.0) * torch.exp2(torch.randint(-20, 20, a.shape, generator=g).float())
    assert torch.equal(quotient_fp64(a, b), a / b)
    assert torch.equal(quotient(a, b), a / b)  # eager: fp32 division itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quotient_of_a_half_precision_tensor_is_its_fp32_values_divided_once(dtype):
    """A BF16 or FP16 numerator by a broadcast fp32 divisor (a weight's rows by their scales), or by a number:
    the fp32 quotient of its exact fp32 values, rounded once (the fp64 reference), in fp32; the numerator is
    left as it was."""
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())).to(dtype)
    before = a.clone()
    for b in ((torch.rand(64, 1, generator=g) + 0.5) * 1e-2, 127.0):
        got = quotient(a, b)
        assert got.dtype == torch.float32
        assert torch.equal(got, quotient_fp64(a.double(), b))
    assert torch.equal(a, before)


def test_an_inplace_quotient_divides_the_callers_fp32_temporary_and_only_that():
    """`inplace` reuses an fp32 numerator's storage for the quotient (no second buffer of its size), with the
    values of the out-of-place quotient; without it, or for a BF16 numerator, the numerator is left as it was."""
    a = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    d = torch.rand(8, 1, generator=torch.Generator().manual_seed(3)) + 0.5
    want = quotient(a, d)
    assert want.data_ptr() != a.data_ptr()
    half = a.to(torch.bfloat16)
    assert quotient(half, d, inplace=True).data_ptr() != half.data_ptr()
    got = quotient(a, d, inplace=True)
    assert got.data_ptr() == a.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "nvfp4", "mxfp4", "hif4"])
def test_quantize_leaves_its_input_as_it_was_and_widens_exactly(fmt, dtype):
    """Quantizing never writes to its input (it divides a widened copy in place, never the caller's fp32
    tensor), and a BF16/FP16 input quantizes exactly as its fp32 values do (the widening is exact)."""
    x = (torch.randn(16, 128, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    before = x.clone()
    got = quantize(x, fmt, "block" if FORMATS[fmt].is_fp4 else "channel")
    assert torch.equal(x, before)
    want = quantize(x.float(), fmt, "block" if FORMATS[fmt].is_fp4 else "channel")
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))


@pytest.mark.parametrize("fmt,granularity", [("int8", "token"), ("fp8_e4m3", "channel"), ("nvfp4", "block"),
                                             ("mxfp4", "block")])
def test_no_host_reads_quantizes_alike_without_reading_back_and_a_nan_propagates(fmt, granularity):
    """Under `no_host_reads` quantize reads no value back to the host (the finiteness check that does is
    skipped), gives the same codes and scales, and a non-finite input turns its group's values non-finite (NaN; inf under MXFP4, whose E8M0 NaN scale decodes so)."""
    from qurl_mcore.quant.qtensor import no_host_reads
    from tests.host_syncs import HostReads

    x = torch.randn(4, 64)
    with HostReads() as checked:
        want = quantize(x, fmt, granularity)
    with HostReads() as reads, no_host_reads():
        got = quantize(x, fmt, granularity)
    assert checked.count >= 1 and reads.count == 0, reads.ops
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_fp32(), want.scale_fp32())
    x[1, 2] = float("nan")
    with no_host_reads():
        values = quantize(x, fmt, granularity, batch_dims=1).dequantize()  # NVFP4: a global scale per row
    assert not values[1].isfinite().all() and values[[0, 2, 3]].isfinite().all()
