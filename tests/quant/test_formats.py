"""Element formats against independent references: torch's float8 dtypes, the hand-written E2M1 grid,
a brute-force nearest-point search, and torch's E8M0 dtype."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qurl_mcore.quant import E2M1_GRID, quantize
from qurl_mcore.quant.formats import (_e2m1_encode_by_binade, decode, e2m1_decode, e2m1_encode, e8m0_exponent, pack_fp4,
                                      unpack_fp4)

HAND_GRID = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0}


def test_e2m1_grid_is_exactly_the_fp4_values():
    decoded = {float(v) for v in e2m1_decode(torch.arange(16, dtype=torch.uint8))}
    assert decoded == HAND_GRID
    assert set(E2M1_GRID) | {-v for v in E2M1_GRID} == HAND_GRID
    # code by code, bit for bit (code 8 is -0.0)
    by_code = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    assert torch.equal(e2m1_decode(torch.arange(16, dtype=torch.uint8)).view(torch.int32), by_code.view(torch.int32))


def _rne_reference(v: float) -> float:
    """Nearest E2M1 value by brute force; a tie goes to the code with an even mantissa bit (code % 2 == 0)."""
    pos = list(E2M1_GRID)
    a = min(abs(v), 6.0)
    dist = [abs(a - g) for g in pos]
    best = min(dist)
    cands = [i for i, d in enumerate(dist) if d == best]
    code = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
    return pos[code] if v >= 0 else -pos[code]


def test_e2m1_rounds_to_nearest_even_at_every_midpoint_and_between():
    points = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # every tie
    points += [p + d for p in points for d in (-1e-3, 1e-3)] + [6.0, 7.9, 0.1, 0.0]
    x = torch.tensor(points + [-p for p in points], dtype=torch.float32)
    got = e2m1_decode(e2m1_encode(x.clamp(-6, 6)))
    want = torch.tensor([_rne_reference(float(v)) for v in x])
    assert torch.equal(got, want)
    # ties by hand: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert got[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("encode", [e2m1_encode, _e2m1_encode_by_binade], ids=["eager", "compiled_formula"])
def test_e2m1_matches_brute_force_on_every_half_precision_value(encode):
    """Every fp16 number in [-6, 6] (all of E2M1's ties and their neighbours among them), both signs, through
    each of the encoder's two formulas (torch.compile takes the second; here it runs eagerly)."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = x[x.isfinite() & (x.abs() <= 6)]
    grid = torch.tensor(E2M1_GRID)
    dist = (x.abs()[:, None] - grid).abs()
    best = dist == dist.min(dim=1, keepdim=True).values
    # the nearest point; of two, the one with the even code
    code = torch.where(best.sum(1) == 1, best.int().argmax(1), (best & (torch.arange(8) % 2 == 0)).int().argmax(1))
    want = torch.where(x < 0, -grid[code], grid[code])
    assert torch.equal(e2m1_decode(encode(x)), want)
    assert torch.equal(encode(x) >> 3, (x < 0).to(torch.uint8))  # -0.0 keeps code 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-6, 6, allow_nan=False, width=32), min_size=1, max_size=64))
def test_e2m1_matches_brute_force(values):
    x = torch.tensor(values, dtype=torch.float32)
    want = torch.tensor([_rne_reference(float(v)) for v in x])
    assert torch.equal(e2m1_decode(e2m1_encode(x)), want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=65))
def test_fp4_pack_unpack_round_trip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_fp4(c)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(codes) + 1) // 2
    assert torch.equal(unpack_fp4(packed, len(codes)), c)
    # low nibble holds the first element of each pair
    assert int(packed[0]) & 0xF == codes[0]
    # views at an odd byte offset and strided ones pack and unpack alike (pairs are read as int16)
    wide = torch.tensor([0] + codes, dtype=torch.uint8)
    assert torch.equal(pack_fp4(wide[1:]), packed)
    assert torch.equal(pack_fp4(torch.stack([c, c], 1)[:, 0]), packed)
    assert torch.equal(unpack_fp4(torch.cat([packed[:1], packed])[1:], len(codes)), c)


@pytest.mark.parametrize("fmt,dtype,fmax", [("fp8_e4m3", torch.float8_e4m3fn, 448.0),
                                             ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
@pytest.mark.parametrize("granularity", ["tensor", "token", "block"])
def test_fp8_equals_torch_cast_of_scaled_tensor(fmt, dtype, fmax, granularity):
    x = torch.randn(8, 256) * torch.logspace(-3, 3, 256)
    q = quantize(x, fmt, granularity)
    if granularity == "tensor":
        scale = x.abs().amax() / fmax
        ref = (x / scale).to(dtype)
    elif granularity == "token":
        scale = x.abs().amax(-1, keepdim=True) / fmax
        ref = (x / scale).to(dtype)
    else:  # 1x128 blocks
        xb = x.reshape(8, 2, 128)
        scale = xb.abs().amax(-1, keepdim=True) / fmax
        ref = (xb / scale).to(dtype).reshape(8, 256)
    assert q.data.dtype == dtype
    assert torch.equal(q.codes().reshape(8, 256).view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(q.scale.reshape(-1), scale.reshape(-1))


def _fp8_grid(dtype):
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    return torch.unique(vals[torch.isfinite(vals)])


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_every_element_is_rounded_to_a_nearest_grid_point_of_its_block(fmt, granularity):
    """|x - x'| equals the distance from x/s to the nearest representable value (clamped to the format's range),
    times s: i.e. at most half a quantization step of its block, and exactly that when in range."""
    x = torch.randn(16, 128) * 3
    x[3, 5] = 80.0  # an outlier
    q = quantize(x, fmt, granularity)
    s = q.scale_fp32()
    grouped = q.granularity.group(x, q.shape)
    scaled = grouped / s
    if fmt == "int8":
        grid = torch.arange(-127, 128, dtype=torch.float32)
    elif fmt.startswith("fp8"):
        grid = _fp8_grid(q.data.dtype)
    else:
        grid = torch.tensor(sorted(HAND_GRID))
    target = scaled.clamp(grid.min(), grid.max()).reshape(-1, 1)
    nearest_dist = (target - grid.reshape(1, -1)).abs().min(dim=1).values
    got = decode(q.codes(), q.spec).reshape(-1, 1)
    assert torch.equal((got - target).abs().reshape(-1), nearest_dist)
    # and the dequantized tensor is exactly those grid values times the scale
    assert torch.equal(q.granularity.group(q.dequantize(), q.shape), got.reshape(grouped.shape) * s)


def test_int8_error_at_most_half_a_step():
    x = torch.randn(32, 64)
    q = quantize(x, "int8", "channel")
    s = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(q.scale, s)
    assert ((q.dequantize() - x).abs() <= s / 2 + 1e-7).all()
    assert q.codes().abs().max() == 127


def test_nvfp4_scale_semantics():
    x = torch.randn(4, 64)
    x[2, 17] = 50.0
    q = quantize(x, "nvfp4", "block")
    assert q.block_shape == (1, 16) and q.scale.dtype == torch.float8_e4m3fn
    g = x.abs().amax() / (6 * 448)
    assert torch.equal(q.global_scale, g)
    blocks = x.reshape(4, 4, 16)
    want = (blocks.abs().amax(-1, keepdim=True) / 6 / g).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale.view(torch.uint8), want.view(torch.uint8))
    # the tensor's amax sits in a block whose E4M3 scale is exactly 448, and comes back exactly
    assert float(q.scale[2, 1].float()) == 448.0
    assert torch.isclose(q.dequantize()[2, 17], torch.tensor(50.0))
    # changing one element changes only its own block's scale
    y = x.clone()
    y[0, 3] = 10.0
    qy = quantize(y, "nvfp4", "block")
    changed = (qy.scale.float() != q.scale.float()).reshape(-1).nonzero().reshape(-1).tolist()
    assert changed == [0]


def test_mxfp4_scale_semantics():
    x = torch.randn(2, 96) * 5
    q = quantize(x, "mxfp4", "block")
    assert q.block_shape == (1, 32) and q.scale.dtype == torch.uint8
    amax = x.reshape(2, 3, 32).abs().amax(-1)
    for (i, j) in itertools.product(range(2), range(3)):
        e = int(np.floor(np.log2(float(amax[i, j])))) - 2
        assert int(q.scale[i, j, 0]) == e + 127
        # same byte as torch's own E8M0 dtype for the power of two
        assert int(torch.tensor(2.0 ** e).to(torch.float8_e8m0fnu).view(torch.uint8)) == e + 127
    # scales are powers of two
    s = q.scale_fp32()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def test_e8m0_exponent_zero_block_is_smallest_scale():
    assert e8m0_exponent(torch.tensor([0.0, 1.0, 6.0, 8.0])).tolist() == [-127, -2, 0, 1]


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "token", "block"])
def test_zeros_give_zeros_never_nan(fmt, granularity):
    x = torch.randn(4, 64)
    x[1] = 0.0
    out = quantize(x, fmt, granularity).dequantize()
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(64))
    assert torch.equal(quantize(torch.zeros(3, 32), fmt, granularity).dequantize(), torch.zeros(3, 32))
