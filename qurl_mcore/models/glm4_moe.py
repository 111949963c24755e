"""GLM-4.5, GLM-4.6 and GLM-4.5-Air (`glm4_moe`): grouped-query attention with q/k/v biases (attention_bias),
an optional RMSNorm on q and k per head (use_qk_norm: GLM-4.5's, not Air's) and RoPE on the first half of each
head (partial_rotary_factor 0.5, rotate-half pairs: Megatron's rotary_percent), then DeepSeek-V3's MLP half
(`deepseek_v3.MOE_AFTER_DENSE`): the first `first_k_dense_replace` layers dense, the others a sigmoid router
with an expert bias (one expert group: n_group 1) and the routed scaling factor, routed experts and one shared
expert. The multi-token-prediction layer is left out of RL, as DeepSeek-V3's.
"""
from __future__ import annotations

from .deepseek_v3 import MOE_AFTER_DENSE, SHARED_WIDTH
from .llama import ATTENTION, EMBEDDING, FINAL
from .slots import Architecture

GLM4_MOE = Architecture(
    "glm4_moe", EMBEDDING + ATTENTION + MOE_AFTER_DENSE + FINAL, always=frozenset({"sigmoid_router"}),
    computed=SHARED_WIDTH,
    tiny={"head_dim": 32, "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
          "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0, "norm_topk_prob": True})
