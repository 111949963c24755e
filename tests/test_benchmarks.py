"""The benchmarks the GPU check runs, run small on the CPU so that a lent GPU's few minutes are not spent on a
script that cannot start (the ratios they print are not asserted: speed lives in benchmarks/)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rollout_kernels_run_and_print_every_case():
    out = subprocess.run([sys.executable, "benchmarks/rollout_kernels.py", "--device", "cpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    decode = re.findall(r"^  (int8|fp8_e4m3) +M=(\d+) +\[(\d+), (\d+)\]  x[0-9.]+$", out.stdout, re.M)
    assert len(decode) == 2 * 3 * 2  # formats x batches x shapes
    ratios = ", ".join(rf"{fmt} {requant} x[0-9.]+" for fmt in ("int8", "fp8_e4m3", "nvfp4")
                       for requant in ("eager", "compiled"))
    assert re.search(rf"^requant: 7 linears, copy [0-9.]+ ms; {ratios}$", out.stdout, re.M), out.stdout
    assert "graphs: skipped (CUDA graphs need a GPU)" in out.stdout


def test_the_7b_weight_set_is_qwen25_7b_linears():
    """28 layers x (q, k, v, o, gate, up, down), shapes [out, in] from the card (hidden 3584, KV 4 x 128,
    intermediate 18944)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollout_kernels

    per_layer = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)]
    linears = rollout_kernels.qwen25_7b_linears()
    assert sorted(linears) == sorted(per_layer * 28)
