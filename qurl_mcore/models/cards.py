"""Architecture cards: the shape fields of public models' config.json, for sizing a run (`qurl plan`) when the
checkpoint is not on this machine. No weights, no downloads.

The values are the public config.json values of each Hugging Face repository (the fields the planner reads;
rope and tokenizer fields left out). `card(name)` finds one by the checkpoint directory's basename, so a
config's `model.path: /models/Qwen2.5-Math-7B` sizes as Qwen2.5-Math-7B wherever the path is absent; an
"-Instruct" suffix names the same shape as its base model.

"DeepSeek-V3-shape" is a shape only, sized with the Qwen3-MoE table (model_type qwen3_moe, so q/k norms too): its
multi-head latent attention (MLA) is approximated by grouped-query attention with 128 heads of 128 and 2 key-value
heads (512 cached values per token and layer; MLA caches 576), all 61 layers are MoE (the real model's first 3 are
dense), and the multi-token-prediction module is left out. It counts 707B parameters, 5% more than the real 671B.
"""
from __future__ import annotations

from typing import Any

_QWEN25 = {"model_type": "qwen2", "tie_word_embeddings": False}
_QWEN3 = {"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}
_QWEN3_MOE = {"model_type": "qwen3_moe", "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "norm_topk_prob": True}
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
    "DeepSeek-V3-shape": {"model_type": "qwen3_moe", "shape_only": True, "hidden_size": 7168,
                          "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
                          "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 129280,
                          "tie_word_embeddings": False, "num_experts": 256, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 2048, "shared_expert_intermediate_size": 2048},
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
