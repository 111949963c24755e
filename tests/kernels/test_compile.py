"""The FP4 kernels compiled for Hopper (sm_90) on the CPU: Triton lowers them to PTX and its bundled ptxas
assembles a cubin, so a GPU's first run is not their first compilation. What the PTX holds: tensor-core MMAs,
correctly rounded divisions only (no `div.full`/`div.approx`: the quantization's scales and codes are
`quantize`'s), and, as launched (`enable_fp_fusion=False`), no FMA contraction (X − Q(X) rounds Q(X) first)."""
from __future__ import annotations

import re

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qurl_mcore.kernels import fp4_gemm

SIGNATURE = {"a_ptr": "*bf16", "stride_am": "i32", "w_ptr": "*u8", "stride_we": "i32", "stride_wn": "i32",
             "s_ptr": "*u8", "stride_se": "i32", "stride_sn": "i32", "wg_ptr": "*fp32", "c_ptr": "*bf16",
             "stride_cm": "i32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "padded_ptr": "*i32", "slots": "i32",
             "N": "i32", "K": "i32"}


@pytest.mark.parametrize("nv, block, gated", [(True, 16, True), (False, 32, False)])
def test_the_rc_kernels_compile_for_hopper_with_exact_quantization(nv, block, gated):
    consts = {"A_DIV": 8 if gated else 1, "NV": nv, "RC": True, "GATED": gated, "BS": block, "BM": 16, "BN": 64,
              "BK": 64}
    kernel = triton.compile(ASTSource(fp4_gemm.fp4_moe_gemm, {**SIGNATURE, **dict.fromkeys(consts, "constexpr")},
                                      consts),
                            target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"] and re.search(r"\bmma\b|\bwgmma\b|mma\.sync", ptx)
    assert not re.search(r"div\.(full|approx)", ptx)
    assert not re.search(r"\bfma\.rn\.f32", ptx)
