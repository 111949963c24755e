"""The dense decoder family: Llama (SmolLM2), Qwen2 and Qwen3. One table, three model types that differ only in
the features every config of theirs has (Qwen2: q/k/v biases; Qwen3: an RMSNorm on q and k per head).

Each layer: RMSNorm, grouped-query attention with RoPE, RMSNorm, SwiGLU MLP. The MoE families reuse the
attention half of this table (`ATTENTION`) and the model's ends (`EMBEDDING`, `FINAL`).
"""
from __future__ import annotations

from .slots import Architecture, Slot

#: Megatron and HF prefixes of layer {layer}
MEGATRON_LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."
_L, _H = MEGATRON_LAYER, HF_LAYER

EMBEDDING = (
    Slot("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "rows", "embedding",
         lambda s: ((s.vocab, s.hidden),)),
)
ATTENTION = (
    Slot(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.hidden,),), uaq=("attn_norm",)),
    Slot(_L + "self_attention.linear_qkv.weight", tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv",
         "attention", lambda s: tuple((n * s.head_dim, s.hidden) for n in (s.heads, s.kv_heads, s.kv_heads)),
         sglang=_H + "self_attn.qkv_proj", uaq=("q", "k", "v")),
    Slot(_L + "self_attention.linear_qkv.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv",
         "attention", lambda s: tuple((n * s.head_dim,) for n in (s.heads, s.kv_heads, s.kv_heads)),
         uaq=("q_bias", "k_bias", "v_bias"), needs="qkv_bias"),
    Slot(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "replicated", "norm",
         lambda s: ((s.head_dim,),), needs="qk_norm"),
    Slot(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "replicated", "norm",
         lambda s: ((s.head_dim,),), needs="qk_norm"),
    Slot(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "columns", "attention",
         lambda s: ((s.hidden, s.heads * s.head_dim),), sglang=_H + "self_attn.o_proj", uaq=("o",)),
    Slot(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated", "norm",
         lambda s: ((s.hidden,),), uaq=("mlp_norm",)),
)
MLP = (
    Slot(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up", "mlp",
         lambda s: ((s.intermediate, s.hidden),) * 2, sglang=_H + "mlp.gate_up_proj", uaq=("gate", "up"),
         layers="dense"),
    Slot(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "columns", "mlp",
         lambda s: ((s.hidden, s.intermediate),), sglang=_H + "mlp.down_proj", uaq=("down",), layers="dense"),
)
FINAL = (
    Slot("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "norm", lambda s: ((s.hidden,),)),
    Slot("output_layer.weight", ("lm_head.weight",), "rows", "output", lambda s: ((s.vocab, s.hidden),),
         needs="untied"),
    # tied embeddings under pipeline parallelism: the last stage keeps a copy of the embedding as its output
    # layer (Megatron all-reduces the two gradients)
    Slot("output_layer.weight", ("model.embed_tokens.weight",), "rows", "output", lambda s: ((s.vocab, s.hidden),),
         needs="tied", exported=False),
)

_SLOTS = EMBEDDING + ATTENTION + MLP + FINAL
LLAMA = Architecture("llama", _SLOTS, tiny={})
QWEN2 = Architecture("qwen2", _SLOTS, always=frozenset({"qkv_bias"}), tiny={})
QWEN3 = Architecture("qwen3", _SLOTS, always=frozenset({"qk_norm"}), tiny={"head_dim": 32})
