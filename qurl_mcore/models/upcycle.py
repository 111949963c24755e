"""Sparse upcycling: a dense Llama checkpoint made into a Mixtral-style MoE (`smollm2-moe`), so that a MoE study
starts from a model that already solves the task instead of a random one.

Every layer's SwiGLU MLP (W_gate, W_up, W_down) becomes E experts

    W_e = W + ε·σ(W)·N_e,   N_e ~ N(0, 1) elementwise, σ(W) the matrix's standard deviation,

and a router G ~ N(0, ρ²) of shape [E, hidden] is added. Mixtral's router renormalises its top-k softmax
probabilities, so with ε = 0 the layer computes Σ_{e∈topk} p_e/Σ_{j∈topk} p_j · MLP(x) = MLP(x): the MoE is the
dense model exactly, whatever the router picks. ε > 0 breaks the experts' symmetry, so that training can
specialise them; a small ρ makes the logits ≪ 1, so the routing starts near uniform. Attention, norms and
embeddings are copied; the output matrix is untied (SGLang's Mixtral has no tied head).
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import cache_dir, publish
from .smollm2 import hf_checkpoint

_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
#: Llama's MLP projection -> Mixtral's expert tensor (gate, up, down)
_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_DENSE_ONLY = ("mlp_bias", "pretraining_tp")  # Llama config fields Mixtral has no use for
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def upcycled_config(dense: Mapping, num_experts: int, top_k: int) -> dict:
    """The Mixtral config of a dense Llama config `dense` (its dict): same attention, width and RoPE,
    `num_experts` experts of the dense MLP's width, top-`top_k` routing, untied output matrix."""
    if dense.get("model_type") != "llama":
        raise ValueError(f"upcycling reads a Llama checkpoint; this one is {dense.get('model_type')!r}")
    if dense.get("mlp_bias") or dense.get("attention_bias"):
        raise ValueError("upcycling a Llama with biases is not supported: Mixtral's linears have none")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    out = {k: v for k, v in dense.items() if k not in _DENSE_ONLY and not k.startswith("_")}
    out.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
               num_experts_per_tok=top_k, tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=0.0,
               output_router_logits=False, router_jitter_noise=0.0)
    out.pop("attention_bias", None)
    return out


def upcycle_state(state: Mapping[str, torch.Tensor], num_experts: int, noise: float, router_std: float,
                  generator: torch.Generator, tied: bool) -> dict[str, torch.Tensor]:
    """A dense Llama state dict (HF names) as the Mixtral one of the module docstring: each MLP matrix W copied
    into `num_experts` experts W + noise·σ(W)·N (noise in float32, stored in W's dtype), a router
    N(0, router_std²) per layer, everything else as it is; `tied`: add `lm_head.weight` from the embedding."""
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for name in sorted(state):  # a fixed order, so a seed gives the same experts
        w = state[name]
        m = _MLP.fullmatch(name)
        if m is None:
            out[name] = w
            continue
        layer, proj = m.groups()
        layers.add(int(layer))
        base = w.float()
        sigma = base.std()
        for e in range(num_experts):
            noisy = base + noise * sigma * torch.randn(base.shape, generator=generator)
            out[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_EXPERT[proj]}.weight"] = noisy.to(w.dtype)
    if not layers:
        raise ValueError("no Llama MLP weights (model.layers.N.mlp.*_proj.weight) to upcycle")
    hidden = state["model.embed_tokens.weight"].shape[1]
    dtype = state["model.embed_tokens.weight"].dtype
    for layer in sorted(layers):
        router = router_std * torch.randn(num_experts, hidden, generator=generator)
        out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = router.to(dtype)
    if tied:
        out["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return out


def upcycle_checkpoint(dense_dir: Path, out_dir: Path, num_experts: int = 4, top_k: int = 2, noise: float = 0.01,
                       router_std: float = 1e-3, seed: int = 0) -> Path:
    """Write the upcycled MoE of the HF Llama checkpoint `dense_dir` (one safetensors file) to `out_dir`, with
    the dense checkpoint's tokenizer files."""
    dense = json.loads((dense_dir / "config.json").read_text())
    config = upcycled_config(dense, num_experts, top_k)
    state = load_file(str(dense_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    moe = upcycle_state(state, num_experts, noise, router_std, generator, tied=bool(dense.get("tie_word_embeddings")))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in moe.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (dense_dir / name).is_file():
            shutil.copy(dense_dir / name, out_dir / name)
    return out_dir


def smollm2_moe_checkpoint(num_experts: int = 4, top_k: int = 2, seed: int = 0) -> Path:
    """SmolLM2-135M-Instruct upcycled (`model.path: smollm2-moe`): 4 experts, top-2, ε = 0.01, ρ = 1e-3, made
    once and cached. 4 experts, not Mixtral's 8: its 30 layers then hold 0.40B parameters, whose fp32 Adam
    state a 24 GiB CPU machine trains beside an engine (8 experts: 0.72B)."""
    out = cache_dir() / f"smollm2-moe-e{num_experts}-top{top_k}-seed{seed}"
    if (out / "model.safetensors").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-moe-"))
    try:
        upcycle_checkpoint(hf_checkpoint(), tmp, num_experts, top_k, seed=seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, out)
