"""Megatron GPTModels for HF Llama (SmolLM2), Qwen2, Qwen3 and Qwen3-MoE configs.

The mapping of architectural features (all four: RMSNorm, SwiGLU, RoPE, GQA, no linear biases):
  qwen2      q/k/v biases               -> add_qkv_bias
  qwen3(*)   RMSNorm on q and k per head -> qk_layernorm
  qwen3_moe  softmax router, top-k, renormalised (norm_topk_prob) -> top-k of the logits, then softmax over
             them (moe_router_pre_softmax=False): exp(l_i)/Σ_topk exp(l_j) = p_i/Σ_topk p_j, HF's formula
  tied word embeddings (SmolLM2)         -> share_embeddings_and_output_weights
Parallel sizes are read from Megatron's initialised groups; sequence parallelism defaults to on when TP > 1
(Megatron requires it for MoE with TP > 1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from qurl_mcore.models.registry import architecture
from qurl_mcore.precision import train_spec

from .spec import gpt_spec, te_fp8_available


def load_hf_config(hf: Any):
    """An HF config from a config object or a checkpoint directory; its model_type must be supported."""
    if isinstance(hf, (str, Path)):
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(hf)
    architecture(hf)  # refuses an unsupported model_type
    return hf


def rope_theta(hf_config) -> float:
    """RoPE base θ (transformers 5 keeps it in rope_parameters); scaled RoPE variants are refused."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError(f"RoPE type {params['rope_type']!r} is not supported (only the default)")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def gpt_config(hf_config, **overrides: Any):
    """The Megatron TransformerConfig of an HF config (fp32 parameters, no dropout, no fusions: the settings
    under which Megatron and HF logits agree to fp32 rounding). `overrides` replace any field."""
    hf = load_hf_config(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    arch = architecture(hf)
    have = arch.features(hf.to_dict())
    moe = arch.moe
    if moe and (getattr(hf, "mlp_only_layers", None) or hf.decoder_sparse_step != 1):
        raise NotImplementedError("Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1)")
    kw: dict[str, Any] = dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias="qkv_bias" in have,
        qk_layernorm="qk_norm" in have,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        variable_seq_lengths=ps.get_pipeline_model_parallel_world_size() > 1,  # batches vary in shape
        moe_token_dispatcher_type="alltoall",  # the one that allows variable sequence lengths
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=tp > 1,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    if moe:
        kw.update(
            num_moe_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_router_pre_softmax=not hf.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


#: train.recompute -> Megatron's activation recomputation settings
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},  # core attention: the s x s part
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def build_gpt(
    hf_config, *, precision: str = "bf16", scope: str = "auto", fmt: str | None = None,
    dtype: torch.dtype = torch.float32, recompute: str = "none", core_attention: str | None = None,
    **overrides: Any
):
    """A randomly initialised GPTModel shaped like `hf_config` (object or checkpoint dir), its linears
    following the trainer side of `precision` under `scope`/`fmt` (see `gpt_spec`), its parameters `dtype`
    on the current device (the CUDA device when there is one), recomputing activations as `recompute` says
    (`RECOMPUTE`), with the core attention `core_attention` (`spec.CORE_ATTENTION`; by default SDPA on CUDA,
    Megatron's local one on the CPU). Load weights with `convert.load_hf_weights`. FP8 training on Transformer
    Engine gets Megatron's fp8 settings."""
    hf = load_hf_config(hf_config)
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; use one of {list(RECOMPUTE)}")
    if train_spec(precision, fmt).weight_granularity == "tensor" and te_fp8_available():
        overrides = {"fp8": "e4m3", "fp8_recipe": "tensorwise", **overrides}
    overrides = {"params_dtype": dtype, "pipeline_dtype": dtype, "bf16": dtype == torch.bfloat16,
                 "use_cpu_initialization": not torch.cuda.is_available(), **RECOMPUTE[recompute], **overrides}
    config = gpt_config(hf, **overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_spec(config, precision=precision, scope=scope, fmt=fmt,
                                        core_attention=core_attention),
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
    )
    if torch.cuda.is_available():  # torch-built norms and the router come on the CPU in fp32: every parameter on
        for param in model.parameters():  # the GPU in `dtype`, as in Megatron's Float16Module
            param.data = param.data.to(device=torch.cuda.current_device(), dtype=dtype)
    return model
