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
_HS = _H + "mlp.shared_expert."


def routed(block: str, router: str, gate: str, up: str, down: str) -> tuple[Slot, ...]:
    """The router and routed SwiGLU experts of a layer whose HF MoE block is `model.layers.{layer}.<block>`, its
    router `<block>.<router>` and expert e's projections `<block>.experts.{e}.<gate|up|down>`; SGLang's FusedMoE of
    the layer is `<block>.experts`."""
    hm = _H + block + "."
    he = hm + "experts.{expert}."
    return (
        Slot(_L + "mlp.router.weight", (hm + router + ".weight",), "replicated", "router",
             lambda s: ((s.experts, s.hidden),), uaq=("router",)),
        Slot(_E + "linear_fc1.weight", (he + gate + ".weight", he + up + ".weight"), "gate_up", "experts",
             lambda s: ((s.moe_intermediate, s.hidden),) * 2, sglang=hm + "experts", uaq=("gate", "up")),
        Slot(_E + "linear_fc2.weight", (he + down + ".weight",), "columns", "experts",
             lambda s: ((s.hidden, s.moe_intermediate),), sglang=hm + "experts", uaq=("down",)),
    )


MOE = routed("mlp", "gate", "gate_proj", "up_proj", "down_proj") + (
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
