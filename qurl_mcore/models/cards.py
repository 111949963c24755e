"""Architecture cards: the shape fields of public models' config.json, for sizing a run (`qurl plan`) when the
checkpoint is not on this machine. No weights, no downloads.

The values are the public config.json values of each Hugging Face repository (the fields the planner reads;
rope and tokenizer fields left out). `card(name)` finds one by the checkpoint directory's basename, so a
config's `model.path: /models/Qwen2.5-Math-7B` sizes as Qwen2.5-Math-7B wherever the path is absent; an
"-Instruct" suffix names the same shape as its base model.

DeepSeek-V3 and the GLM-4.5 models are counted without their multi-token-prediction layer
(num_nextn_predict_layers 0), which RL leaves out (`qurl_mcore.models.deepseek_v3`): 671B, the published size of
DeepSeek-V3's main model (its checkpoint holds 685B with the MTP module).
"""
from __future__ import annotations

from typing import Any

_QWEN25 = {"model_type": "qwen2", "tie_word_embeddings": False}
_QWEN3 = {"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}
_QWEN3_MOE = {"model_type": "qwen3_moe", "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "norm_topk_prob": True}
_GLM45 = {"model_type": "glm4_moe", "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
          "vocab_size": 151552, "tie_word_embeddings": False, "attention_bias": True, "partial_rotary_factor": 0.5,
          "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
          "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 0}
_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "tie_word_embeddings": False}

#: name -> the shape fields of its config.json
CARDS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "DeepSeek-R1-Distill-Qwen-1.5B": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960,
                                      "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                      "vocab_size": 151936},
    "Qwen2.5-7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "Qwen2.5-Math-7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "Qwen2.5-32B": {**_QWEN25, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064},
    "Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    "Qwen3-30B-A3B": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "Qwen3-235B-A22B": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "num_experts": 128,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 1536},
    "Llama-3.1-8B": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8},
    "Llama-3.1-70B": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8},
    "Mixtral-8x7B": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 32000, "tie_word_embeddings": False, "num_local_experts": 8,
                     "num_experts_per_tok": 2},
    "Qwen1.5-MoE-A2.7B": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "vocab_size": 151936, "tie_word_embeddings": False, "num_experts": 60,
                          "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                          "norm_topk_prob": False},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "vocab_size": 129280, "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
                    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "moe_intermediate_size": 2048,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                    "norm_topk_prob": True, "num_nextn_predict_layers": 0, "max_position_embeddings": 163840,
                    "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "GLM-4.5": {**_GLM45, "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92,
                "n_routed_experts": 160, "moe_intermediate_size": 1536, "first_k_dense_replace": 3,
                "use_qk_norm": True},
    "GLM-4.5-Air": {**_GLM45, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
                    "n_routed_experts": 128, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                    "use_qk_norm": False},
}


def card(name: str) -> dict[str, Any]:
    """The card of `name` (a model name or a checkpoint path whose basename is one; "-Instruct" names its base
    model's shape). Raises KeyError naming the cards there are."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    for key in (base, base.removesuffix("-Instruct")):
        if key in CARDS:
            return dict(CARDS[key])
    raise KeyError(f"no architecture card for {name!r}; give a checkpoint directory with a config.json, or one "
                   f"of {list(CARDS)}")
