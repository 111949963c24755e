"""The FP4 kernels compiled for Hopper (sm_90) on the CPU: Triton lowers them to PTX and its bundled ptxas
assembles a cubin, so a GPU's first run is not their first compilation. What the PTX holds: tensor-core MMAs,
correctly rounded divisions only (no `div.full`/`div.approx`: the quantization's scales and codes are
`quantize`'s), and, as launched (`enable_fp_fusion=False`), no FMA contraction (X − Q(X) rounds Q(X) first).
The MXFP4 variant by `tl.dot_scaled` compiles for Blackwell (sm_100) to its block-scaled FP4 MMA."""
from __future__ import annotations

import re

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qurl_mcore.kernels import fp4_gemm, fp4_moe

SIGNATURE = {"a_ptr": "*bf16", "stride_am": "i32", "w_ptr": "*u8", "stride_we": "i32", "stride_wn": "i32",
             "s_ptr": "*u8", "stride_se": "i32", "stride_sn": "i32", "wg_ptr": "*fp32", "c_ptr": "*bf16",
             "stride_cm": "i32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "padded_ptr": "*i32", "slots": "i32",
             "N": "i32", "K": "i32"}


def _ptx(sm: int, nv: bool, block: int, gated: bool, scaled: bool) -> str:
    """The RC kernel's PTX for sm_`sm`, with the host's tile sizes, after checking a cubin was assembled."""
    consts = {"A_DIV": 8 if gated else 1, "NV": nv, "RC": True, "GATED": gated, "SCALED": scaled, "BS": block,
              "BM": fp4_moe.BLOCK_M, "BN": fp4_moe.SCALED_BLOCK_N if scaled else fp4_moe.BLOCK_N,
              "BK": fp4_moe.BLOCK_K}
    kernel = triton.compile(ASTSource(fp4_gemm.fp4_moe_gemm, {**SIGNATURE, **dict.fromkeys(consts, "constexpr")},
                                      consts),
                            target=GPUTarget("cuda", sm, 32), options={"enable_fp_fusion": False})
    assert kernel.asm["cubin"]
    ptx = kernel.asm["ptx"]
    assert not re.search(r"div\.(full|approx)", ptx)
    assert not re.search(r"\bfma\.rn\.f32", ptx)
    return ptx


@pytest.mark.parametrize("nv, block, gated", [(True, 16, True), (False, 32, False)])
def test_the_rc_kernels_compile_for_hopper_with_exact_quantization(nv, block, gated):
    assert re.search(r"\bmma\b|\bwgmma\b|mma\.sync", _ptx(90, nv, block, gated, scaled=False))


def test_the_scaled_mxfp4_kernel_compiles_for_blackwell_to_its_block_scaled_fp4_mma():
    """E2M1 x E2M1 with E8M0 scales per 32 in tcgen05's MMA, not decomposed into bf16 MMAs."""
    ptx = _ptx(100, False, 32, True, scaled=True)
    assert re.search(r"tcgen05\.mma\S*kind::mxf4\.block_scale\.block32", ptx)
    assert not re.search(r"kind::f16|mma\.sync", ptx)
