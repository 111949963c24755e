"""DeepSeek-V3 (and Kimi K2, which shares the architecture): multi-head latent attention (MLA), the first
`first_k_dense_replace` layers with a dense SwiGLU MLP, the others MoE with shared experts and a sigmoid router.

MLA, per layer (h hidden, a heads, r_q q_lora_rank, r_kv kv_lora_rank, d_n qk_nope_head_dim, d_r
qk_rope_head_dim, d_v v_head_dim):
  q     = q_b_proj(RMSNorm_qa(q_a_proj(x)))            [a·(d_n + d_r)], per head [nope, rope]
  c, kr = kv_a_proj_with_mqa(x)                         [r_kv + d_r]: the latent and the one RoPE key of all heads
  k, v  = kv_b_proj(RMSNorm_kva(c))                     [a·(d_n + d_v)], per head [k_nope, v]
  attention over [q_nope, RoPE(q_rope)] · [k_nope, RoPE(kr)] / sqrt(d_n + d_r), then o_proj.
The RoPE dimensions are interleaved pairs (the config's rope_interleave, always true for DeepSeek's
checkpoints), which Megatron's MLA reads the same way. Megatron's names: linear_q_down_proj, q_layernorm,
linear_q_up_proj, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj. An engine caches per token
and layer only c and kr (`Shape.kv_bytes_per_token`).

Which projections a scope quantizes: q_b_proj and o_proj are `attention` (scope "all"); the down projections
q_a_proj and kv_a_proj_with_mqa (1.5% of DeepSeek-V3's weights) and the up projection of the kv latent, kv_b_proj,
are `latent`, full precision on both sides under every scope. The down projections because Megatron-Core
0.16.1's MLA accepts only its stock linear classes for them; kv_b_proj because SGLang decodes with the absorbed
form, W_uk and W_uv (its `w_kc`, `w_vc`) rebuilt in bf16 from the full-precision kv_b_proj after every load and
push, so a quantized kv_b_proj would reach the prefill's tokens and never a generated one. Under scope
"experts" the first layers' dense MLPs are quantized with the routed experts (`mlp`, as a dense model's MLP is),
the shared experts are not (they run for every token: `qurl_mcore.precision`).

The router (noaux_tc): scores sigmoid(w·x); the choice adds the expert bias `e_score_correction_bias` (Megatron's
`router.expert_bias`, a buffer the converter carries like a parameter) and keeps the `topk_group` of `n_group`
expert groups with the largest sum of their top-2 biased scores; the weights are the unbiased scores of the
top-k, renormalised (norm_topk_prob) and multiplied by `routed_scaling_factor`. The shared experts are one
SwiGLU MLP n_shared_experts · moe_intermediate_size wide (`mlp.shared_experts`).

The multi-token-prediction module (num_nextn_predict_layers, the checkpoint's layer 61 in DeepSeek-V3) is a
pretraining aid: RL trains and rolls out the 61 layers of the main model, and a checkpoint's MTP tensors are
not loaded (the converter refuses them: drop `model.layers.61.*` and set num_nextn_predict_layers 0).

UAQ on MLA (`qurl_mcore.uaq`): input_layernorm·s with q_a_proj/s and kv_a_proj_with_mqa/s, kv_a_layernorm·s with
kv_b_proj's k_nope rows /s and its v rows unchanged (so v·s), and o_proj/s against v·s: of the quantized
projections, o_proj holds W/s (the full-precision kv_b_proj's role, "kv_b", is split per head into its
k_nope and v rows). q_b_proj keeps W: the s would go into q_a_layernorm's γ, whose Megatron name
(self_attention.q_layernorm) is also Qwen3's and GLM-4.5's q norm, which UAQ leaves alone, and a name has one
meaning in every table.
"""
from __future__ import annotations

from .llama import EMBEDDING, FINAL, HF_LAYER, MEGATRON_LAYER, MLP
from .qwen3_moe import routed, shared
from .slots import Architecture, Slot

_L, _H = MEGATRON_LAYER, HF_LAYER
_A, _HA = _L + "self_attention.", _H + "self_attn."

MLA = (
    Slot(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.hidden,),), uaq=("attn_norm",)),
    Slot(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",), "rows", "latent",
         lambda s: ((s.q_lora_rank, s.hidden),), uaq=("latent",)),
    Slot(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.q_lora_rank,),)),
    Slot(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",), "rows", "attention",
         lambda s: ((s.heads * s.head_dim, s.q_lora_rank),), sglang=_HA + "q_b_proj"),
    Slot(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",), "rows", "latent",
         lambda s: ((s.kv_lora_rank + s.qk_rope_head_dim, s.hidden),), uaq=("latent",)),
    Slot(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.kv_lora_rank,),), uaq=("kv_latent_norm",)),
    Slot(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",), "rows", "latent",
         lambda s: ((s.heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),), uaq=("kv_b",)),
    Slot(_A + "linear_proj.weight", (_HA + "o_proj.weight",), "columns", "attention",
         lambda s: ((s.hidden, s.heads * s.v_head_dim),), sglang=_HA + "o_proj", uaq=("o",)),
    Slot(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.hidden,),), uaq=("mlp_norm",)),
)

#: the sigmoid router's expert bias (noaux_tc), a buffer of Megatron's router
EXPERT_BIAS = (
    Slot(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",), "replicated", "router",
         lambda s: ((s.experts,),), layers="moe", fp32=True),
)

#: a dense MLP on the first layers, then the router with its bias, the routed experts and the shared experts
MOE_AFTER_DENSE = MLP + routed("mlp", "gate", "gate_proj", "up_proj", "down_proj") + EXPERT_BIAS + \
    shared("mlp.shared_experts")

#: the shared experts' width of DeepSeek-V3's and GLM-4.5's configs
SHARED_WIDTH = {"shared_expert_intermediate_size": lambda c: c.get("n_shared_experts", 0) *
                c.get("moe_intermediate_size", 0)}

DEEPSEEK_V3 = Architecture(
    "deepseek_v3", EMBEDDING + MLA + MOE_AFTER_DENSE + FINAL, always=frozenset({"mla", "sigmoid_router"}),
    computed=SHARED_WIDTH,
    tiny={"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
          "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0, "norm_topk_prob": True,
          # DeepSeek-V3's YaRN (factor 40 over 4096 positions there; over 2048 / 32 = 64 here)
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                              "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0},
          # fields of DeepSeek-V3's config.json that transformers 5 drops from its class and SGLang reads
          "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
