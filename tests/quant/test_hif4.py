import math

import numpy as np
import pytest
import torch

from qurl_mcore.quant import PerBlock, hif4, make_spec, quant_linear, quantize, residual_quantize
from qurl_mcore.quant.formats import e1m2_decode, e1m2_encode, e6m2_decode, e6m2_encode, e6m2_round
from qurl_mcore.quant.qtensor import no_host_reads

# --- the codes ---------------------------------------------------------------------------------------------------


def test_e1m2_codes_are_cann_hifloat4_values():
    # CANN's HiFloat4 benchmark: codes 0x0-0x7 are 0, 0.25, 0.5, 0.75 (subnormal), 1, 1.25, 1.5, 1.75; bit 3 the sign.
    values = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    assert e1m2_encode(values).tolist() == list(range(8))
    assert e1m2_decode(torch.arange(8, dtype=torch.uint8)).tolist() == values.tolist()
    assert e1m2_encode(torch.tensor([-0.25, -1.0, -1.75, -0.0, 100.0])).tolist() == [0x9, 0xC, 0xF, 0x0, 0x7]
    assert e1m2_decode(torch.tensor([0x9, 0xC, 0xF], dtype=torch.uint8)).tolist() == [-0.25, -1.0, -1.75]


def test_e1m2_rounds_ties_to_the_even_code():
    # midpoints k/4 + 1/8: 0.125 -> 0 (code 0), 0.375 -> 0.5 (code 2), 0.625 -> 0.5, 0.875 -> 1, 1.125 -> 1, 1.375 -> 1.5
    mids = torch.tensor([0.125, 0.375, 0.625, 0.875, 1.125, 1.375, 1.625])
    assert e1m2_decode(e1m2_encode(mids)).tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5]


def test_e6m2_values_and_codes():
    # code = (e + 48)·4 + m for (1 + m/4)·2^e: 1.0 -> 48·4 = 192, 1.5 -> 194, 1.5·2^15 -> 63·4 + 2 = 254,
    # 1.25·2^-48 -> 1 (code 0 is zero).
    v = torch.tensor([1.0, 1.5, 1.5 * 2.0**15, 1.25 * 2.0**-48, 0.0, 3.5, 0.4375])
    codes = e6m2_encode(v)
    assert codes.tolist() == [192, 194, 254, 1, 0, (1 + 48) * 4 + 3, (-2 + 48) * 4 + 3]
    assert e6m2_decode(codes).tolist() == v.tolist()


def test_e6m2_rounds_to_nearest_even_and_saturates():
    v = torch.tensor([1.1, 1.125, 1.375, 1.4285714, 3.1, 1e9, 2.0**-60])
    # 1.1 -> 1.0; ties 1.125 -> 1.0 (m = 0 even), 1.375 -> 1.5 (m = 2); 10/7 -> 1.5; 3.1 -> 3.0 (step 0.5);
    # above 1.5·2^15 saturates there; below the smallest code rises to 1.25·2^-48.
    want = [1.0, 1.0, 1.5, 1.5, 3.0, 1.5 * 2.0**15, 1.25 * 2.0**-48]
    assert e6m2_round(v).tolist() == want


# --- the three-level scale, by hand ------------------------------------------------------------------------------

# Two units. Unit 0: amax 7, a = E6M2(7/7) = 1.
#   G8 0 = x[0:8], amax 7 >= 4·a: b = 1.
#     G4 0 = [7, 0, 0, 0]: 7/2 >= 2: c = 1, s = 4: 7/4 = 1.75 -> 7.
#     G4 1 = [1, -0.3, 0.5, 0.1]: 1/2 < 2: c = 0, s = 2: 0.5 -> 1; -0.15·4 = -0.6 -> -0.25·2; 0.25 -> 0.5; 0.05 -> 0.
#   G8 1 = x[8:16], amax 3 < 4: b = 0.
#     G4 2 = [3, 2.9, -1.3, 0.6]: 3 >= 2: c = 1, s = 2: 1.5 -> 3; 1.45 -> 1.5·2; -0.65 -> -0.75·2; 0.3 -> 0.25·2.
#     G4 3 = [0.9, 0.375, 0.125, -0.625]: c = 0, s = 1: 0.9 -> 1; ties 0.375 -> 0.5, 0.125 -> 0, -0.625 -> -0.5.
# Unit 1: amax 10, a = E6M2(10/7 = 1.43) = 1.5.
#   G8 0: 10/1.5 = 6.7 >= 4: b = 1. G4 0 = [10, 5, 0, 0]: 10/3 >= 2: c = 1, s = 6: 1.67 -> 1.75·6 = 10.5,
#   0.83 -> 0.75·6 = 4.5. G4 1 = [2, 0, 0, 0]: 2/3 < 2: c = 0, s = 3: 0.67 -> 0.75·3 = 2.25.
X = torch.zeros(128)
X[0:16] = torch.tensor([7.0, 0, 0, 0, 1.0, -0.3, 0.5, 0.1, 3.0, 2.9, -1.3, 0.6, 0.9, 0.375, 0.125, -0.625])
X[64:72] = torch.tensor([10.0, 5, 0, 0, 2.0, 0, 0, 0])
WANT = torch.zeros(128)
WANT[0:16] = torch.tensor([7.0, 0, 0, 0, 1.0, -0.5, 0.5, 0.0, 3.0, 3.0, -1.5, 0.5, 1.0, 0.5, 0.0, -0.5])
WANT[64:72] = torch.tensor([10.5, 4.5, 0, 0, 2.25, 0, 0, 0])


def test_hand_computed_units():
    q = hif4.quantize(X)
    assert q.unit_scale.tolist() == [192, 194]  # E6M2 codes of 1.0 and 1.5
    assert q.micro8.nonzero().tolist() == [[0, 0], [1, 0]]
    assert q.micro4.nonzero().tolist() == [[0, 0], [0, 2], [1, 0]]
    assert q.dequantize().tolist() == WANT.tolist()


def test_saturation_when_the_unit_scale_rounds_down():
    # amax 7.7: a = E6M2(1.1) = 1, b = c = 1, s = 4: 7.7/4 = 1.925 saturates at 1.75 -> 7.
    x = torch.zeros(64)
    x[0] = -7.7
    assert hif4.fake_quantize(x)[0].item() == -7.0


def test_zero_unit_and_partial_unit():
    # A unit of zeros gets scale code 0 and decodes to zeros; a partial last unit (here 70 = 64 + 6) is padded
    # with zeros for its scales: [2, 1] has amax 2, a = E6M2(2/7 = 0.286) = 0.25·1.25 = 0.3125 (step 1/16
    # in [0.25, 0.5): 0.286·16 = 4.57 -> 5); 2/0.3125 = 6.4 >= 4: b = 1; 6.4/2 >= 2: c = 1: s = 1.25,
    # 2/1.25 = 1.6 -> 1.5 -> 1.875, 1/1.25 = 0.8 -> 0.75 -> 0.9375.
    x = torch.zeros(70)
    x[64:66] = torch.tensor([2.0, 1.0])
    q = hif4.quantize(x)
    assert q.codes.shape == (70,) and q.unit_scale[0].item() == 0
    assert hif4.fake_quantize(x).tolist() == [0.0] * 64 + [1.875, 0.9375] + [0.0] * 4


def test_storage_is_4_5_bits_a_value():
    q = hif4.quantize(torch.randn(3, 128))
    bits = q.codes.numel() * 4 + q.unit_scale.numel() * 8 + q.micro8.numel() + q.micro4.numel()
    assert bits / q.codes.numel() == hif4.BITS_PER_VALUE == 4.5


# --- against a scalar reference of the definition ---------------------------------------------------------------


def _reference_unit(unit: np.ndarray) -> list[float]:
    """The module docstring's definition, element by element in numpy float32 and Python's round (half-even)."""
    f = np.float32
    amax = float(np.abs(unit).max())
    if amax == 0:
        return [0.0] * len(unit)
    v = f(amax) / f(7)
    m, e = math.frexp(float(v))
    step = 2.0 ** (e - 3)
    a = f(min(max(round(float(v) / step) * step, 1.25 * 2.0**-48), 1.5 * 2.0**15))
    out = []
    for g8 in range(0, 64, 8):
        b = 1 if f(np.abs(unit[g8:g8 + 8]).max()) / a >= 4 else 0
        for g4 in range(g8, g8 + 8, 4):
            c = 1 if f(np.abs(unit[g4:g4 + 4]).max()) / (a * f(2**b)) >= 2 else 0
            s = a * f(2 ** (b + c))
            for xi in unit[g4:g4 + 4]:
                k = min(round(abs(float(f(xi) / s)) * 4), 7)
                out.append(math.copysign(k / 4, xi) * float(s) if k else 0.0)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_scalar_reference_of_the_definition(seed):
    g = torch.Generator().manual_seed(seed)
    # units of very different ranges, so that all three levels vary
    x = torch.randn(4, 256, generator=g) * torch.exp2(torch.randint(-6, 7, (4, 256 // 8), generator=g)).repeat_interleave(8, -1)
    got = hif4.fake_quantize(x)
    want = torch.tensor([_reference_unit(u) for u in x.reshape(-1, 64).numpy()]).reshape(x.shape)
    assert torch.equal(got, want)
    q = hif4.quantize(x)
    assert q.micro8.any() and (~q.micro8).any() and q.micro4.any() and (~q.micro4).any()


def test_non_finite_input_is_an_error():
    with pytest.raises(ValueError, match="non-finite"):
        hif4.quantize(torch.tensor([1.0, float("nan")]))


# --- as a format of the numerics table: QTensor storage, the quantized linear ------------------------------------


def test_hand_computed_units_through_the_qtensor_storage():
    """X above as a QTensor: the codes two a byte (the first element low), per unit 4 scale bytes: the E6M2 code,
    the level-2 bits (bit i: G8 i), the level-3 bits (bit j of bytes 2-3: G4 j). Unit 0 has G8 0 and G4 0, 2 set:
    [192, 0b1, 0b101, 0]; unit 1 G8 0 and G4 0: [194, 1, 1, 0]."""
    q = quantize(X, "hif4", "block")
    assert q.granularity == PerBlock((1, 64)) and q.data.dtype == torch.uint8 and q.data.shape == (64,)
    assert q.scale.reshape(-1, 4).tolist() == [[192, 1, 5, 0], [194, 1, 1, 0]]
    # x[0] = 7 -> code 7 (1.75·4), x[1] = 0 -> 0: byte 0x07; x[4] = 1 -> 0.5·2 (code 2), x[5] = -0.3 -> -0.25·2
    # (code 0x9): byte 0x92
    assert q.data[0].item() == 0x07 and q.data[2].item() == 0x92
    assert q.dequantize().tolist() == WANT.tolist()
    assert torch.equal(q.codes(), hif4.quantize(X).codes)


@pytest.mark.parametrize("shape", [(4, 256), (3, 70), (2, 3, 130), (64,)])
def test_qtensor_storage_is_hif4_bitwise(shape):
    """quantize(x, "hif4") -> dequantize equals hif4.py's own quantizer, codes and unpacked levels too, for full
    and partial units, any leading dims, and a stack of tensors (batch_dims=1: no per-tensor scale to split)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    ref = hif4.quantize(x)
    for batch_dims in (0, 1) if len(shape) > 1 else (0,):
        q = quantize(x, "hif4", "block", batch_dims=batch_dims)
        assert torch.equal(q.dequantize(torch.float32), ref.dequantize())
        assert torch.equal(q.codes(), ref.codes)
        levels = hif4.unpack_scale(q.scale)  # in grouped layout: [rows, units, ...]
        assert all(torch.equal(a.reshape(b.shape), b) for a, b in zip(levels, (ref.unit_scale, ref.micro8, ref.micro4)))
    assert torch.equal(quantize(x.to(torch.bfloat16), "hif4", "block").dequantize(), hif4.fake_quantize(
        x.to(torch.bfloat16)))


def test_residual_quantization_is_hif4_of_the_residual():
    """RC(x) = Q(x) + Q(x − Q(x)) through `residual_quantize` equals the sum composed from hif4.py."""
    x = torch.randn(6, 192)
    first, second = residual_quantize(x, "hif4", "block", batch_dims=1)
    q = hif4.fake_quantize(x)
    assert torch.equal(first.dequantize(torch.float32), q)
    assert torch.equal(second.dequantize(torch.float32), hif4.fake_quantize(x - q))
    assert (x - q - hif4.fake_quantize(x - q)).norm() < (x - q).norm() / 4


def test_hif4_takes_its_own_units_only():
    with pytest.raises(ValueError, match="hif4 scales its own 1 x 64 units of a row, not per channel"):
        quantize(torch.randn(4, 64), "hif4", "channel")
    with pytest.raises(ValueError, match=r"blocks are fixed at \(1, 64\)"):
        quantize(torch.randn(4, 64), "hif4", "block", block_shape=(1, 32))


def test_non_finite_units_raise_eagerly_and_decode_to_nan_without_host_reads():
    """Eagerly a NaN is an error; inside the trainer's GEMMs (`no_host_reads`) its unit gets E6M2's unused
    all-ones code, NaN, so the unit decodes to NaN (and the step is skipped) while the other units stay exact."""
    x = torch.randn(2, 128)
    x[1, 70] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "hif4", "block")
    with no_host_reads():
        q = quantize(x, "hif4", "block")
    assert q.scale[1, 1, 0].item() == 255 and e6m2_decode(q.scale[1, 1, 0]).isnan()
    out = q.dequantize(torch.float32)
    assert out[1, 64:].isnan().all() and not out[1, :64].isnan().any() and not out[0].isnan().any()
    assert torch.equal(out[0], hif4.fake_quantize(x[0]))


def _rc(t):
    """RC token by token from hif4.py: each row Q(t) + Q(t − Q(t))."""
    q = hif4.fake_quantize(t)
    return q + hif4.fake_quantize(t - q)


def test_a_quantized_linear_in_hif4_is_the_formula_composed_from_hif4():
    """quant_linear with rc_both in HiF4 against Y = RC(X)·Q(W)ᵀ + b, dX = RC(dY)·Q(W), dW = RC(dY)ᵀ·RC(X), with
    Q = hif4.fake_quantize along the last dim (weights per row, activations and gradients per token), and the
    same GEMMs in fp32: bitwise."""
    x = torch.randn(10, 128, requires_grad=True)
    w = torch.randn(48, 128, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    g = torch.randn(10, 48)
    spec = make_spec("rc_both", "hif4", backend="emulated")
    assert spec.weight_granularity == spec.act_granularity == spec.grad_granularity == PerBlock((1, 64))
    y = quant_linear(x, w, b, spec=spec)
    y.backward(g)
    wq, xq, gq = hif4.fake_quantize(w.detach()), _rc(x.detach()), _rc(g)
    assert torch.equal(y.detach(), xq @ wq.t() + b.detach())
    assert torch.equal(x.grad, gq @ wq)
    assert torch.equal(w.grad, gq.t() @ xq)
    assert torch.equal(b.grad, g.sum(0))
