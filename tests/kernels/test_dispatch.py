"""Where the FP4 kernels serve: an engine's FP4 experts and FP4 linears on CUDA with `kernel: auto` (traced on
a fake H100: the kernels' custom op runs as its fake, shapes only), the emulation everywhere else."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore import kernels
from qurl_mcore.fakecuda import run_traced
from qurl_mcore.quant.linear import make_spec

from . import workers

GEMM = "qurl::fp4_moe_gemm"


def test_an_fp4_engine_on_cuda_routes_experts_and_linears_through_the_kernels():
    """qurl_fp4_rc and qurl_fp4 on CUDA (kernel: auto): the experts run two fused GEMMs (gate/up with SiLU,
    then down) and the linear one, with outputs of the input's device and shape; `kernel: qurl` keeps the
    emulation (no kernel op)."""
    calls = run_traced(workers.fp4_kernel_calls, [("qurl_fp4_rc", "auto"), ("qurl_fp4", "auto"),
                                                  ("qurl_fp4_rc", "qurl")])
    for method in ("qurl_fp4_rc", "qurl_fp4"):
        assert calls[(method, "auto")] == {"experts": [GEMM, GEMM, "cuda (4, 128)"],
                                           "linear": [GEMM, "cuda (4, 96)"]}
    assert calls[("qurl_fp4_rc", "qurl")] == {"experts": ["cuda (4, 128)"], "linear": ["cuda (4, 96)"]}


@pytest.mark.parametrize("mode, fmt, device, serves", [
    ("rc_forward", "nvfp4", "cuda", True), ("rc_none", "mxfp4", "cuda", True),
    ("rc_forward", "nvfp4", "cpu", False),  # the CPU keeps the emulation, the reference
    ("rc_none", "int8", "cuda", False), ("rc_none", "fp8_e4m3", "cuda", False),  # SGLang's W8A8 kernels
    ("bf16", None, "cuda", False),
])
def test_the_kernels_serve_fp4_on_cuda_only(mode, fmt, device, serves):
    assert kernels.serves(make_spec(mode, fmt), torch.device(device)) is serves


def test_the_kernels_serve_only_the_formats_own_blocks():
    """An FP4 spec with per-token activations is not the kernels' function: emulated."""
    assert not kernels.serves(make_spec("rc_none", "nvfp4", act_granularity="token"), torch.device("cuda"))
