"""Independent references for the Megatron tests: HF transformers' own forward, routing and log-probs."""
from __future__ import annotations

import functools

import torch

TOKENS = 49152


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
    """[layers, b, s, k] expert ids HF's Qwen3-MoE router picks, by descending probability."""
    model = hf_model(path)
    routes = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: routes.append(out[2]))
             for layer in model.model.layers]
    try:
        hf_logits(path, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([r.view(*ids.shape, -1) for r in routes])


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TOKENS, (batch, seq), generator=torch.Generator().manual_seed(seed))
