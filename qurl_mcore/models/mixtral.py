"""Mixtral: Llama's attention (`llama.ATTENTION`), then a softmax router over top-2 routed SwiGLU experts, no
shared expert and no dense layer. The router picks the top-k of softmax(logits) and renormalises them (always:
Mixtral's config has no `norm_topk_prob`), p_i/Σ_topk p_j = exp(l_i)/Σ_topk exp(l_j).

Checkpoint names are Mixtral's own (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`: gate, up,
down). transformers 5 holds a layer's experts as two fused tensors in memory (`mlp.experts.gate_up_proj`
[E, 2i, h], `mlp.experts.down_proj` [E, h, i]) and converts to and from these per-expert names when it loads and
saves (its `conversion_mapping`), so a checkpoint on disk, what the converter and SGLang read, is per expert. The
experts' width is the config's `intermediate_size`.

In SGLang a Mixtral's experts are one FusedMoE, `block_sparse_moe.experts`, quantized or not: SGLang 0.5.23 would
build a Mixtral under a quantization method outside its own list (every qurl method) as `QuantMixtralForCausalLM`,
a linear per expert projection whose routing is never captured; the plugin builds `MixtralForCausalLM` instead
(`qurl_mcore.sglang.architecture`).
"""
from __future__ import annotations

from .llama import ATTENTION, EMBEDDING, FINAL
from .qwen3_moe import routed
from .slots import Architecture

MIXTRAL = Architecture(
    "mixtral", EMBEDDING + ATTENTION + routed("block_sparse_moe", "gate", "w1", "w3", "w2") + FINAL,
    implied={"norm_topk_prob": True}, aliases={"moe_intermediate_size": "intermediate_size"},
    tiny={"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64})
