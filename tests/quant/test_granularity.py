"""Granularities as types: names, groups, the blocks a format fixes, and what the GEMM kernels take; format
facts read from the format's spec."""
import pytest
import torch

from qurl_mcore.quant import (
    FORMATS, GRANULARITIES, Family, PerBlock, PerRow, PerTensor, PerToken, as_granularity, get_format, make_spec,
    quantize,
)
from qurl_mcore.quant.granularity import for_format


def test_names_stand_for_the_types():
    assert GRANULARITIES == {"tensor": PerTensor(), "channel": PerRow(), "token": PerToken(), "block": PerBlock()}
    assert as_granularity("channel") is GRANULARITIES["channel"]
    assert as_granularity(PerBlock((2, 8))) == PerBlock((2, 8))
    assert PerRow() != PerToken() and PerBlock((1, 16)) != PerBlock((1, 32))  # same grouping, other meaning
    assert [str(g) for g in GRANULARITIES.values()] == list(GRANULARITIES)
    with pytest.raises(ValueError, match=r"unknown granularity 'row'; use one of \['tensor', 'channel'"):
        as_granularity("row")


def test_groups_and_what_they_allow():
    x = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    assert PerTensor().group(x, x.shape).shape == (1, 24)
    assert PerRow().group(x, x.shape).shape == PerToken().group(x, x.shape).shape == (4, 6)
    tiles = PerBlock((2, 4)).group(x, x.shape)  # 2 x 2 tiles of 8, the right ones zero-padded
    assert tiles.shape == (2, 2, 8) and torch.equal(tiles[0, 1], torch.tensor([4., 5, 0, 0, 10, 11, 0, 0]))
    for g in (PerTensor(), PerRow(), PerBlock((2, 4))):
        assert torch.equal(g.ungroup(g.group(x, x.shape), x.shape), x)
    assert [g.row_grouped for g in (PerTensor(), PerRow(), PerToken(), PerBlock((1, 32)), PerBlock((2, 4)))] == \
        [False, True, True, True, False]
    assert [g.rowwise for g in (PerTensor(), PerRow(), PerToken(), PerBlock((1, 32)))] == [True, True, True, False]


def test_a_format_fixes_or_fills_the_block():
    assert for_format("block", get_format("nvfp4")) == PerBlock((1, 16))
    assert for_format(PerBlock(), get_format("mxfp4")) == PerBlock((1, 32))
    assert for_format("block", get_format("int8")) == PerBlock((1, 128))
    assert for_format("block", get_format("int8"), (128, 128)) == PerBlock((128, 128))
    assert for_format("token", get_format("nvfp4")) == PerToken()
    with pytest.raises(ValueError, match="fixed at"):
        for_format(PerBlock((1, 32)), get_format("nvfp4"))
    with pytest.raises(ValueError, match="drop block_shape"):
        for_format(PerBlock((2, 8)), get_format("int8"), (4, 4))
    # a QTensor and a spec carry the block as applied, whichever way it was asked for
    w = torch.randn(256, 256)
    assert quantize(w, "fp8_e4m3", PerBlock((128, 128))).granularity == PerBlock((128, 128))
    assert torch.equal(quantize(w, "fp8_e4m3", PerBlock((128, 128))).dequantize(),
                       quantize(w, "fp8_e4m3", "block", block_shape=(128, 128)).dequantize())
    assert make_spec("rc_none", "nvfp4").act_granularity == PerBlock((1, 16))


def test_format_facts_live_on_the_spec():
    assert {n: (f.family, f.bits, f.block) for n, f in FORMATS.items()} == {
        "int8": (Family.INT, 8, None), "fp8_e4m3": (Family.FP8, 8, None), "fp8_e5m2": (Family.FP8, 8, None),
        "nvfp4": (Family.FP4, 4, 16), "mxfp4": (Family.FP4, 4, 32), "hif4": (Family.FP4, 4, 64)}
    assert [n for n, f in FORMATS.items() if f.is_fp4] == ["nvfp4", "mxfp4", "hif4"]
    # scale bytes: what a quantized weight stores beside its codes (test_plan checks the sizes end to end)
    for name, f in FORMATS.items():
        q = quantize(torch.randn(32, 64), name, "block" if f.is_fp4 else "channel")
        assert q.scale.element_size() * q.scale.shape[-1] == f.scale_bytes and q.scale.shape[-1] == f.scale_width
        assert (0 if q.global_scale is None else q.global_scale.element_size()) == f.tensor_scale_bytes
    assert {n for n, f in FORMATS.items() if f.kernels} == {"int8", "fp8_e4m3", "nvfp4", "mxfp4"}
