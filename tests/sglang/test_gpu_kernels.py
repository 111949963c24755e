"""The CUDA path: SGLang's own W8A8 kernels on weights quantized by qurl_mcore.quant (skipped on CPU)."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.quant import get_format, make_spec, quantize_weight, quantized_linear

from ..conftest import requires_cuda


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_sglang_w8a8_kernels_match_the_qurl_forward(fmt):
    from qurl_mcore.sglang import kernels

    if not kernels.linear_available(get_format(fmt), torch.device("cuda")):
        pytest.skip(f"SGLang has no {fmt} per-channel kernel on this GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 512, device="cuda", generator=gen).bfloat16()
    w = (0.05 * torch.randn(768, 512, device="cuda", generator=gen)).bfloat16()
    spec = make_spec("rc_none", fmt)
    wq = quantize_weight(w, spec)
    got = kernels.w8a8_linear(x, wq, None).float()
    want = quantized_linear(x, wq, None, spec).float()
    # same codes and scales up to activation rounding ties (half-away vs half-even) and a bf16 output
    assert ((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_cuda_engine_refits_and_restores():
    from .conftest import checkpoint_tensors, model_path, prompt_ids
    from qurl_mcore.rollout import EngineConfig, LocalEngine

    path = model_path("qwen3_moe")
    config = EngineConfig(path, "qurl_int8", device="cuda", mem_fraction_static=0.3, max_total_tokens=4096)
    with LocalEngine(config) as engine:
        ids = prompt_ids(path)
        greedy = {"max_new_tokens": 8, "temperature": 0.0}
        before = engine.generate([ids], greedy)[0]
        tensors = checkpoint_tensors(path)
        engine.push_weights([(k, v * 0.5) for k, v in tensors.items() if k.endswith("proj.weight")], version="h")
        assert engine.generate([ids], greedy)[0].output_logprobs != before.output_logprobs
        engine.push_weights(list(tensors.items()), version="orig")
        after = engine.generate([ids], greedy)[0]
        assert (after.output_ids, after.output_logprobs) == (before.output_ids, before.output_logprobs)
