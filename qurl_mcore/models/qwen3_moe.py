"""The Qwen-MoE family: Qwen3-MoE and Qwen2-MoE. Dense attention (`llama.ATTENTION`: Qwen3-MoE's with q/k norms,
Qwen2-MoE's with q/k/v biases), then a softmax router over routed SwiGLU experts; shared experts
(`shared_expert`) where a config has `shared_expert_intermediate_size`. A routed expert's weights, every expert of a
layer, are one SGLang FusedMoE module.

Qwen2-MoE scales its shared expert's output by a sigmoid gate, sigmoid(w·x) with w [1, hidden]
(`shared_expert_gate`, Megatron's `shared_experts.gate_weight`): a router-like weight, replicated and never
quantized. It reads the same normalised x as the router, which UAQ scales by s, so it takes the router's role
(w/s: w/s · s·x = w·x, the gate unchanged).
"""
from __future__ import annotations

from .llama import ATTENTION, EMBEDDING, FINAL, HF_LAYER, MEGATRON_LAYER
from .slots import Architecture, Slot

_L, _H = MEGATRON_LAYER, HF_LAYER
_E = _L + "mlp.experts.local_experts.{expert}."


def routed(block: str, router: str, gate: str, up: str, down: str) -> tuple[Slot, ...]:
    """The router and routed SwiGLU experts of a layer whose HF MoE block is `model.layers.{layer}.<block>`, its
    router `<block>.<router>` and expert e's projections `<block>.experts.{e}.<gate|up|down>`. In SGLang the
    layer's experts are one FusedMoE, `<block>.experts`."""
    hm = _H + block + "."
    he = hm + "experts.{expert}."
    fc1, fc2 = (he + gate, he + up), (he + down,)
    return (
        Slot(_L + "mlp.router.weight", (hm + router + ".weight",), "replicated", "router",
             lambda s: ((s.experts, s.hidden),), uaq=("router",), layers="moe"),
        Slot(_E + "linear_fc1.weight", tuple(n + ".weight" for n in fc1), "gate_up", "experts",
             lambda s: ((s.moe_intermediate, s.hidden),) * 2, sglang=hm + "experts",
             uaq=("gate", "up"), layers="moe"),
        Slot(_E + "linear_fc2.weight", tuple(n + ".weight" for n in fc2), "columns", "experts",
             lambda s: ((s.hidden, s.moe_intermediate),), sglang=hm + "experts", uaq=("down",),
             layers="moe"),
    )


def shared(block: str) -> tuple[Slot, ...]:
    """A layer's shared experts, one SwiGLU MLP whose HF projections are `model.layers.{layer}.<block>.<gate|up|
    down>_proj` (SGLang packs gate and up as Megatron does), where a config has `shared_experts`."""
    hs = _H + block + "."
    return (
        Slot(_L + "mlp.shared_experts.linear_fc1.weight", (hs + "gate_proj.weight", hs + "up_proj.weight"),
             "gate_up", "shared_experts", lambda s: ((s.shared_intermediate, s.hidden),) * 2,
             sglang=hs + "gate_up_proj", uaq=("gate", "up"), needs="shared_experts", layers="moe"),
        Slot(_L + "mlp.shared_experts.linear_fc2.weight", (hs + "down_proj.weight",), "columns", "shared_experts",
             lambda s: ((s.hidden, s.shared_intermediate),), sglang=hs + "down_proj", uaq=("down",),
             needs="shared_experts", layers="moe"),
    )


MOE = routed("mlp", "gate", "gate_proj", "up_proj", "down_proj") + shared("mlp.shared_expert")

SHARED_EXPERT_GATE = (
    Slot(_L + "mlp.shared_experts.gate_weight", (_H + "mlp.shared_expert_gate.weight",), "replicated", "router",
         lambda s: ((1, s.hidden),), uaq=("router",), needs="shared_expert_gate", layers="moe"),
)

QWEN3_MOE = Architecture(
    "qwen3_moe", EMBEDDING + ATTENTION + MOE + FINAL, always=frozenset({"qk_norm"}),
    tiny={"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
          "decoder_sparse_step": 1, "norm_topk_prob": True})
QWEN2_MOE = Architecture(
    "qwen2_moe", EMBEDDING + ATTENTION + MOE + SHARED_EXPERT_GATE + FINAL, always=frozenset({"shared_expert_gate"}),
    implied={"attention_bias": True}, aliases={"attention_bias": "qkv_bias"},
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
          "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "norm_topk_prob": False})
