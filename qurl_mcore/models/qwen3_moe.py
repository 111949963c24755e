"""The Qwen-MoE family: Qwen3-MoE. Dense attention (the Qwen3 half of `llama.ATTENTION`, with q/k norms), then a
softmax router over routed SwiGLU experts; shared experts (`shared_expert`, as Qwen2-MoE names them) where a
config has `shared_expert_intermediate_size`. A routed expert's weights, every expert of a layer, are one SGLang
FusedMoE module.
"""
from __future__ import annotations

from .llama import ATTENTION, EMBEDDING, FINAL, HF_LAYER, MEGATRON_LAYER
from .slots import Architecture, Slot

_L, _H = MEGATRON_LAYER, HF_LAYER
_E = _L + "mlp.experts.local_experts.{expert}."
_HE = _H + "mlp.experts.{expert}."
_HS = _H + "mlp.shared_expert."

MOE = (
    Slot(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), "replicated", "router",
         lambda s: ((s.experts, s.hidden),), uaq=("router",)),
    Slot(_E + "linear_fc1.weight", (_HE + "gate_proj.weight", _HE + "up_proj.weight"), "gate_up", "experts",
         lambda s: ((s.moe_intermediate, s.hidden),) * 2, sglang=_H + "mlp.experts", uaq=("gate", "up")),
    Slot(_E + "linear_fc2.weight", (_HE + "down_proj.weight",), "columns", "experts",
         lambda s: ((s.hidden, s.moe_intermediate),), sglang=_H + "mlp.experts", uaq=("down",)),
    Slot(_L + "mlp.shared_experts.linear_fc1.weight", (_HS + "gate_proj.weight", _HS + "up_proj.weight"), "gate_up",
         "shared_experts", lambda s: ((s.shared_intermediate, s.hidden),) * 2, sglang=_HS + "gate_up_proj",
         uaq=("gate", "up"), needs="shared_experts"),
    Slot(_L + "mlp.shared_experts.linear_fc2.weight", (_HS + "down_proj.weight",), "columns", "shared_experts",
         lambda s: ((s.hidden, s.shared_intermediate),), sglang=_HS + "down_proj", uaq=("down",),
         needs="shared_experts"),
)

QWEN3_MOE = Architecture(
    "qwen3_moe", EMBEDDING + ATTENTION + MOE + FINAL, always=frozenset({"qk_norm"}),
    tiny={"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
          "decoder_sparse_step": 1, "norm_topk_prob": True})
