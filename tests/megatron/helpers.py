"""Independent references for the Megatron tests: HF transformers' own forward, routing and log-probs."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

TOKENS = 49152
#: Llama 3.1's RoPE scaling, as its config.json gives it
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@functools.lru_cache(maxsize=8)
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(ids).logits


def hf_logprobs(path, ids: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) for t ≥ 1, [b, s-1]."""
    logits = hf_logits(path, ids)[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def hf_routes(path, ids: torch.Tensor) -> torch.Tensor:
    """[MoE layers, b, s, k] expert ids HF's routers pick (Qwen3-MoE's by descending probability; DeepSeek-V3's
    by descending biased score), for the layers with a router only."""
    model = hf_model(path)
    routes = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: routes.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        hf_logits(path, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([r.view(*ids.shape, -1) for r in routes])


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TOKENS, (batch, seq), generator=torch.Generator().manual_seed(seed))


def with_config(dst: Path, arch: str, **fields) -> Path:
    """A copy of tiny-`arch` at `dst` with config.json fields replaced (the same weights)."""
    import json

    from qurl_mcore.models.tiny import tiny_checkpoint

    path = Path(shutil.copytree(tiny_checkpoint(arch), dst))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


def expert_biased_deepseek_v3(dst: Path) -> Path:
    """A copy of tiny-deepseek_v3 whose MoE layer has an e_score_correction_bias (a permutation of
    linspace(-0.5, 0.5, 8)) large enough to change which experts and expert groups are picked; the tiny
    checkpoint's own bias is zero."""
    from safetensors.torch import load_file, save_file

    from qurl_mcore.models.tiny import tiny_checkpoint

    path = Path(shutil.copytree(tiny_checkpoint("deepseek_v3"), dst))
    state = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(state[name], torch.zeros(8, dtype=state[name].dtype))
    state[name] = (torch.linspace(-0.5, 0.5, 8)[torch.randperm(8, generator=torch.Generator().manual_seed(0))]
                   .to(state[name].dtype))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path
