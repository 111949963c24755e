"""QuRL's update-aware quantization rescales the trainer's weights invariantly, W·X = (W/s)·(sX): the RMSNorm
gain in front of a linear is multiplied by s and the linear's weight divided by s. Pushed into a BF16
(unquantized) engine, such weights must leave its outputs unchanged. With s a power of two both rescalings
are exact in BF16, so "unchanged" means bitwise."""
from __future__ import annotations

import pytest
import torch

from .conftest import checkpoint_tensors, local_engine, model_path, prompt_ids

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast

S = 2.0
#: norm -> the linears that read its output (Llama layout)
FOLLOWERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def uaq_scaled(tensors: dict[str, torch.Tensor], s: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        for norm, linears in FOLLOWERS.items():
            if name.endswith(f"{norm}.weight"):
                out[name] = t * s
            elif any(name.endswith(f"{lin}.weight") for lin in linears):
                out[name] = t / s
    return out


@pytest.fixture(scope="module")
def bf16_engine():
    path = model_path("smollm2")
    with local_engine(path, None, dtype="bfloat16") as engine:
        yield engine, path


def test_uaq_scaled_push_leaves_bf16_outputs_unchanged(bf16_engine):
    engine, path = bf16_engine
    ids = prompt_ids(path)
    sampling = {"max_new_tokens": 12, "temperature": 0.0}
    before = engine.generate([ids], sampling, prompt_logprobs=True)[0]
    original = checkpoint_tensors(path)
    scaled = uaq_scaled(original, S)
    assert len(scaled) == 7 * 30  # every layer's two norms and the five linears that follow them
    assert all(not torch.equal(scaled[k], original[k]) for k in scaled)
    engine.push_weights(list(scaled.items()), version="uaq")
    after = engine.generate([ids], sampling, prompt_logprobs=True)[0]
    assert after.output_ids == before.output_ids
    assert after.output_logprobs == before.output_logprobs
    assert after.prompt_logprobs == before.prompt_logprobs
    # the push really landed: taking back only the norm half of the rescaling changes the outputs
    engine.push_weights([(k, original[k]) for k in scaled if "layernorm" in k], version="linears-only")
    broken = engine.generate([ids], sampling, prompt_logprobs=True)[0]
    assert broken.prompt_logprobs != before.prompt_logprobs
    engine.push_weights(list(original.items()), version="original")
