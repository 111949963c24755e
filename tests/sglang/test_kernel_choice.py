"""Which GEMM a quantized rollout linear runs on each GPU: sgl-kernel's `int8_scaled_mm` has CUTLASS kernels for
SM75 to SM90 and raises on SM100 (B200), where the INT8 linear runs `qurl_mcore.quant` (torch._int_mm) instead.
No SGLang needed: the choice reads the device's capability only."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.fakecuda import run_traced
from qurl_mcore.quant import get_format
from qurl_mcore.sglang import kernels


@pytest.mark.parametrize("capability,runs", [((7, 0), False), ((7, 5), True), ((8, 0), True), ((8, 9), True),
                                             ((9, 0), True), ((10, 0), False), ((12, 0), False)])
def test_int8_scaled_mm_runs_on_sm75_to_sm90_only(capability, runs):
    assert kernels.int8_scaled_mm_runs(capability) is runs


def _choices(gpus: list[str]) -> dict[str, tuple[tuple[int, int], bool, bool]]:
    """GPU -> (capability, dense INT8 linear on SGLang's GEMM, INT8 experts on SGLang's Triton runner)."""
    from qurl_mcore.fakecuda import fake_cuda

    out = {}
    for gpu in gpus:
        with fake_cuda(gpu=gpu):
            cuda, spec = torch.device("cuda"), get_format("int8")
            out[gpu] = (tuple(torch.cuda.get_device_capability(cuda)), kernels.linear_available(spec, cuda),
                        kernels.available(spec, cuda))
    return out


def test_the_int8_linear_leaves_sglangs_gemm_on_a_b200_under_the_facade():
    """As the engine asks it on each GPU the façade can be: the dense INT8 linear keeps SGLang's GEMM on an
    A100 and an H100 and leaves it on a B200; the experts keep SGLang's Triton runner (no CUTLASS kernel)."""
    want = {"A100-80GB": ((8, 0), True, True), "H100-80GB": ((9, 0), True, True), "B200": ((10, 0), False, True)}
    assert run_traced(_choices, list(want)) == want
    assert not kernels.linear_available(get_format("int8"), torch.device("cpu"))
