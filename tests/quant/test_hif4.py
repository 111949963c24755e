import math

import numpy as np
import pytest
import torch

from qurl_mcore.quant import hif4
from qurl_mcore.quant.formats import e1m2_decode, e1m2_encode, e6m2_decode, e6m2_encode, e6m2_round

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
