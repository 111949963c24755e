"""The FP8 GEMM's kernel choice by device capability (quant/gemm.py `ROWWISE_FP32_OUT`), on fake GPUs."""
from __future__ import annotations

import pytest

from qurl_mcore.fakecuda import run_traced

from . import workers


@pytest.mark.parametrize("gpu, asked", [("H100-80GB", "torch.float32"), ("B200", "torch.bfloat16")])
def test_rowwise_scaled_mm_asks_for_an_output_the_device_has_a_kernel_for(gpu, asked):
    """N7: SM90 writes fp32 from the row-wise kernel, SM100 only bf16 (then cast to the dtype asked for)."""
    assert run_traced(workers.scaled_mm_out_dtype, gpu) == (asked, "torch.float32")


def test_uaq_scales_mla_heads_on_the_device():
    """UAQ's per-head factors for MLA's kv_b_proj are made on the weight's device: a CPU factor times a CUDA
    weight fails on a GPU (found by tracing DeepSeek-V3's trainer with `qurl plan --trace`)."""
    assert run_traced(workers.uaq_per_head_on_device) == ("cuda:0", "torch.bfloat16")
