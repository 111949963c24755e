"""The benchmarks the GPU check runs, run small on the CPU so that a lent GPU's few minutes are not spent on a
script that cannot start (the ratios they print are not asserted: speed lives in benchmarks/)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_rollout_kernels_run_and_print_every_case():
    """Every case prints; the FP4 MoE kernels (under Triton's interpreter) agree with the emulation within the
    fp32 bound (docs/rollout.md) at every model shape, and both BF16 baselines with bf16 torch ops."""
    out = subprocess.run([sys.executable, "benchmarks/rollout_kernels.py", "--device", "cpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fp4 = re.findall(r"^  (Qwen3-30B-A3B|GLM-4.5) +(qurl_fp4_rc/(?:nv|mx)fp4) +M=1 +error ([0-9.e+-]+)$", out.stdout, re.M)
    assert len(fp4) == 2 * 2 and all(float(error) < 1e-4 for *_, error in fp4), out.stdout
    baselines = re.search(r"bf16 baselines' error vs torch: sglang ([0-9.e+-]+), grouped_mm ([0-9.e+-]+)$", out.stdout,
                          re.M)
    assert baselines and all(float(e) < 2e-2 for e in baselines.groups()), out.stdout
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


def _device_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device_check

    return device_check


#: run in a child process: pytest collecting the device check's GPU tests with the packages the GPU machine
#: lacks made unimportable, as there (an import of any of them raises ModuleNotFoundError)
_COLLECT_WITHOUT = """
import importlib.abc, sys
ABSENT = ("sglang", "sgl_kernel", "flashinfer", "ray", "transformer_engine")
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)", name=name)
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.slow  # collecting imports Megatron and transformers: ~40 s on 2 busy cores
def test_every_gpu_test_of_the_device_check_collects_without_sglang_ray_or_te():
    """The GPU machine has no SGLang, Ray or Transformer Engine: a listed file that imports one at module level
    would make the gpu-tests section collect nothing. Each listed file must collect, with at least one test."""
    dc = _device_check()
    out = subprocess.run([sys.executable, "-c", _COLLECT_WITHOUT, *dc.GPU_TESTS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(dc.GPU_TESTS), out.stdout[-3000:]


def test_device_check_dry_run_reports_every_section_within_its_budget():
    """`--dry-run` (no GPU needed) lists every section in order, running those whose budgets fit in the
    total and reporting the others skipped; the default total leaves the run, setup included, under 5 minutes."""
    dc = _device_check()
    assert dc.BUDGET_S + 60 <= 300  # 60 s: the script's wheel install, imports and nvidia-smi
    for budget in (dc.BUDGET_S, 100):
        out = subprocess.run([sys.executable, "benchmarks/device_check.py", "--dry-run", "--budget-s", str(budget)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = re.findall(r"^SECTION ([\w-]+): (would run|skipped) \((?:budget (\d+) s|.*)\)$", out.stdout, re.M)
        assert [name for name, _, _ in lines] == list(dc.SECTIONS)
        ran = [int(b) for _, what, b in lines if what == "would run"]
        assert ran and sum(ran) <= budget and len(ran) < len(lines)
    assert lines[:2] == [("trainer-padded", "would run", "40"), ("trainer-overlap", "would run", "35")]


@pytest.mark.slow
def test_device_check_padded_and_overlap_sections_run_on_the_cpu():
    """The two trainer sections the GPU check adds (padded micro-batches: N4, N5; 2, 1, 3 micro-batches: N1),
    here on the CPU (SDPA's math backend only), so their first run on a GPU is not the first run at all."""
    dc = _device_check()
    assert dc.varied_batch(1000).input_ids.shape[1] == 61
    padded = dc.padded_section("cpu")
    assert padded.startswith("ok: width 61 -> 61 (emulated FP8, no TE)") and "MATH True/" in padded, padded
    assert dc.overlap_section(length=16).startswith("ok: 2, 1, 3 micro-batches")
