"""Core attention through torch's `scaled_dot_product_attention`: the GPU's fused path without Transformer
Engine. A drop-in for Megatron's local `DotProductAttention` (same constructor and forward), used by
`gpt_spec` on CUDA devices.

  context = softmax(q kᵀ / √d  masked) v      per head; grouped-query heads share their k, v

Megatron's local attention materialises the [b, heads, s, s] scores in fp32 (at s = 8192 and 28 heads that is
7.5 GiB per sequence and layer); SDPA's memory-efficient kernel takes the same boolean mask (padding and
segments, not only causal, which is why this and not TE's causal-typed fused attention) in O(s) memory.
On the CPU `gpt_spec` keeps Megatron's own attention by default (bitwise the stock spec); a test checks that
both agree there.

The mask never masks a whole query row (`logprobs.attention_mask_for`: a padding query attends to itself):
whichever backend SDPA picks may then run, cuDNN included, whose backward gives NaN query gradients for a
fully masked row.
"""
from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """query [sq, b, heads, d], key/value [sk, b, groups, d], attention_mask [b, 1, sq, sk] (True: masked)
    -> context [sq, b, heads·d]. No dropout (RL training runs without)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("SDPAttention runs without dropout; set attention_dropout=0")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPAttention takes an explicit boolean mask (no bias, no packed params)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each group's k, v serve its heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        mask = None if attention_mask is None else ~attention_mask
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=attention_mask is None, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
