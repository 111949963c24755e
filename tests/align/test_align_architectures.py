"""Train-vs-rollout alignment on each MoE architecture's tiny model (docs/align.md): real SGLang engines of the
architecture's own model class against the Megatron trainer, fp32 activations, scope all, NVFP4, 4 prompts x 32
sampled tokens, one process for all of them (`qurl_mcore.align.run_alignment`, what `qurl align` runs).
Each row is an engine start and a trainer forward, so a row runs here only where no other test measures it.

The rows each architecture needs here, the others measured elsewhere in the suite:
  bf16    the same function on both sides (mixtral, glm4_moe; DeepSeek-V3's and Qwen2-MoE's engines equal
          transformers in fp32, tests/sglang/test_cpu_model_classes.py, and the trainer equals transformers,
          tests/megatron/test_convert.py)
  int8    INT8 W8A8 against the full-precision trainer, different by design (qwen2_moe, glm4_moe; Mixtral's and
          DeepSeek-V3's INT8 loops measure it every step, tests/loop/test_e2e_moe.py)
  fp4_rc  symmetric RC, at BF16's level of agreement (every architecture)
Naive FP4 runs in tests/align/test_align.py: with `kv_b_proj` full precision on both sides, DeepSeek-V3's
absorbed MLA no longer flips FP4 codes, so naive FP4 here would measure what RC's row does."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # eight engine starts

ROWS = {"mixtral": ["bf16", "fp4_rc"], "qwen2_moe": ["int8", "fp4_rc"], "glm4_moe": ["bf16", "int8", "fp4_rc"],
        "deepseek_v3": ["fp4_rc"]}

RUN = """
import json, sys
from qurl_mcore.align import run_alignment, stdout_to_stderr
rows = json.loads(sys.argv[1])
with stdout_to_stderr():
    out = {arch: {r["precision"]: r for r in run_alignment(names, f"tiny-{arch}", scope="all", fmt="nvfp4", prompts=4,
                                                           max_new_tokens=32, seed=0)}
           for arch, names in rows.items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, dict]]:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(ROWS)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("arch", list(ROWS))
def test_symmetric_fp4_rc_aligns_on_every_moe_architecture(measured, arch):
    rows = measured[arch]
    print(arch, {name: (round(r["pcc"], 4), r["topk_match_frac"], round(r["mean_abs_logprob_diff"], 4))
                 for name, r in rows.items()})
    assert list(rows) == ROWS[arch] and all(r["tokens"] > 64 for r in rows.values())  # most of the 128 tokens
    if "bf16" in rows:  # the same function: every route and (to fp32 summation order) every log-prob
        assert rows["bf16"]["topk_match_frac"] == 1.0 and rows["bf16"]["mean_abs_logprob_diff"] < 1e-4
    if "int8" in rows:  # close, and measurably not the same function
        assert rows["int8"]["pcc"] > 0.99 and 1e-4 < rows["int8"]["mean_abs_logprob_diff"] < 0.01
    rc = rows["fp4_rc"]  # the trainer runs the engine's quantized function: no code flips, BF16's level
    assert rc["pcc"] > 0.995 and rc["topk_match_frac"] == 1.0 and rc["mean_abs_logprob_diff"] < 1e-3
