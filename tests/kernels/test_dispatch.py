"""Where the FP4 kernels serve: an engine's FP4 experts and FP4 linears on CUDA with `kernel: auto` (traced on
a fake H100 and B200: the kernels' custom op runs as its fake, shapes only), the emulation everywhere else."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore import kernels
from qurl_mcore.fakecuda import run_traced
from qurl_mcore.quant.linear import make_spec

from . import workers

GEMM = "qurl::fp4_moe_gemm"


H100, B200 = "H100-80GB", "B200"
AUTO = [(gpu, method, "auto", fmt) for gpu in (H100, B200) for method in ("qurl_fp4_rc", "qurl_fp4")
        for fmt in ("nvfp4", "mxfp4")]


@pytest.fixture(scope="module")
def calls():
    """The kernel ops of every FP4 method and format with `kernel: auto` on a fake H100 and B200, and of
    `kernel: qurl` on the H100: one traced process."""
    return run_traced(workers.fp4_kernel_calls, [*AUTO, (H100, "qurl_fp4_rc", "qurl", "nvfp4"),
                                                 (H100, "qurl_fp4_rc", "auto", "hif4")])


def test_an_fp4_engine_on_cuda_routes_experts_and_linears_through_the_kernels(calls):
    """qurl_fp4_rc and qurl_fp4 on CUDA (kernel: auto): the experts run two fused GEMMs (gate/up with SiLU,
    then down) and the linear one, with outputs of the input's device and shape; `kernel: qurl` keeps the
    emulation (no kernel op)."""
    for gpu, method, _, fmt in AUTO:
        if (gpu, fmt) != (B200, "mxfp4"):  # that one: dot_scaled (the next test)
            assert calls[(gpu, method, "auto", fmt)] == {"experts": [GEMM, GEMM, "cuda (4, 128)"],
                                                         "linear": [GEMM, "cuda (4, 96)"]}
    assert calls[(H100, "qurl_fp4_rc", "qurl", "nvfp4")] == {"experts": ["cuda (4, 128)"], "linear": ["cuda (4, 96)"]}


def test_hif4_has_no_kernel_and_its_engine_takes_the_reference_path_on_cuda(calls):
    """HiF4 names no GEMM kernel (`FormatSpec.kernels`): with `kernel: auto` on a (fake) H100 its experts and
    linears run the emulation, no kernel op."""
    assert calls[(H100, "qurl_fp4_rc", "auto", "hif4")] == {"experts": ["cuda (4, 128)"], "linear": ["cuda (4, 96)"]}


def test_on_blackwell_mxfp4_takes_the_scaled_dot_and_nvfp4_the_decoded_mmas(calls):
    """On a fake B200 (SM100), `kernel: auto`: MXFP4's GEMMs multiply by `tl.dot_scaled` (the op's `scaled`),
    RC on and off (NVFP4's stay on the decoded bf16 MMAs, as both formats' do on the H100: the test above)."""
    scaled = f"{GEMM} scaled"
    for method in ("qurl_fp4_rc", "qurl_fp4"):
        assert calls[(B200, method, "auto", "mxfp4")] == {"experts": [scaled, scaled, "cuda (4, 128)"],
                                                          "linear": [scaled, "cuda (4, 96)"]}


@pytest.mark.parametrize("mode, fmt, device, serves", [
    ("rc_forward", "nvfp4", "cuda", True), ("rc_none", "mxfp4", "cuda", True),
    ("rc_forward", "nvfp4", "cpu", False),  # the CPU keeps the emulation, the reference
    ("rc_forward", "hif4", "cuda", False), ("rc_none", "hif4", "cuda", False),  # no HiF4 kernel: the reference
    ("rc_none", "int8", "cuda", False), ("rc_none", "fp8_e4m3", "cuda", False),  # SGLang's W8A8 kernels
    ("bf16", None, "cuda", False),
])
def test_the_kernels_serve_fp4_on_cuda_only(mode, fmt, device, serves):
    assert kernels.serves(make_spec(mode, fmt), torch.device(device)) is serves


def test_the_kernels_serve_only_the_formats_own_blocks():
    """An FP4 spec with per-token activations is not the kernels' function: emulated."""
    assert not kernels.serves(make_spec("rc_none", "nvfp4", act_granularity="token"), torch.device("cuda"))
