"""Megatron GPTModels for the HF configs of `qurl_mcore.models.ARCHITECTURES`.

The mapping of architectural features (all: RMSNorm, SwiGLU, RoPE, GQA, no linear biases), read from the
config as its architecture table completes it (`Architecture.config`, `Architecture.features`):
  q/k/v biases (qwen2)                   -> add_qkv_bias
  RMSNorm on q and k per head (qwen3*)   -> qk_layernorm
  MoE: softmax router, top-k, renormalised (norm_topk_prob; mixtral always) -> top-k of the logits, then
             softmax over them (moe_router_pre_softmax=False): exp(l_i)/Σ_topk exp(l_j) = p_i/Σ_topk p_j, HF's
             formula; not renormalised -> softmax over all experts, then top-k (moe_router_pre_softmax=True)
  shared experts (shared_expert_intermediate_size) -> moe_shared_expert_intermediate_size, and Qwen2-MoE's
             sigmoid gate on their output -> moe_shared_expert_gate
  sigmoid router (deepseek_v3): sigmoid scores, the expert bias (noaux_tc), group-limited top-k, renormalised
             and scaled -> moe_router_score_function "sigmoid", moe_router_enable_expert_bias (a fixed bias:
             moe_router_bias_update_rate 0, the checkpoint's, as the engine routes), moe_router_num_groups,
             moe_router_group_topk, moe_router_topk_scaling_factor; the first first_k_dense_replace layers
             dense -> moe_layer_freq [0]*k + [1]*(L-k)
  multi-head latent attention (mla)      -> MLATransformerConfig: q_lora_rank, kv_lora_rank, qk_head_dim (the
             nope part), qk_pos_emb_head_dim, v_head_dim, rope_type "rope"
  RoPE on part of each head (glm4_moe: partial_rotary_factor) -> rotary_percent
  tied word embeddings (SmolLM2)         -> share_embeddings_and_output_weights
  Llama 3's scaled RoPE (rope_type llama3) -> rope_scaling, rope_scaling_factor (`rope_scaling`)
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
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from qurl_mcore.models.registry import architecture, features
from qurl_mcore.models.slots import Shape
from qurl_mcore.recipe import Recipe
from qurl_mcore.stack import Stack, fusions

from .spec import as_recipe, gpt_spec


def load_hf_config(hf: Any):
    """An HF config from a config object or a checkpoint directory; its model_type must be supported."""
    if isinstance(hf, (str, Path)):
        # transformers only where an HF config is read (seconds to import)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(hf)
    architecture(hf)  # refuses an unsupported model_type
    return hf


def _rope_parameters(hf_config) -> dict[str, Any]:
    return getattr(hf_config, "rope_parameters", None) or {}  # transformers 5 keeps RoPE's fields here


def rope_theta(hf_config) -> float:
    """RoPE base θ."""
    return float(_rope_parameters(hf_config).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


#: the parameters of Llama 3's RoPE frequency scaling that megatron-core 0.16.1 fixes (RotaryEmbedding
#: _apply_scaling's defaults; GPTModel passes only the factor): Llama 3.1's and 3.2's values
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling(hf_config) -> dict[str, Any]:
    """GPTModel's RoPE-scaling arguments for an HF config: none for plain RoPE; for Llama 3's (rope_type "llama3":
    frequencies with wavelength beyond original_max/low_freq_factor divided by `factor`, those below
    original_max/high_freq_factor kept, a smooth interpolation between) rope_scaling with its factor. Other
    RoPE types, and llama3 parameters Megatron-Core fixes otherwise (`LLAMA3_FIXED`), are refused."""
    params = _rope_parameters(hf_config)
    kind = params.get("rope_type", "default")
    if kind == "default" or "mla" in features(hf_config):
        return {}  # MLA builds its own rotary embedding, YaRN included, from its config (`_mla`)
    if kind != "llama3":
        raise NotImplementedError(f"RoPE type {kind!r} is not supported; Megatron builds 'default' and 'llama3'")
    given = {k: params.get(k) for k in LLAMA3_FIXED}
    if given != LLAMA3_FIXED:
        raise NotImplementedError(f"llama3 RoPE with {given}: Megatron-Core fixes {LLAMA3_FIXED} and takes only "
                                  "the factor; use a checkpoint with those values")
    return {"rope_scaling": True, "rope_scaling_factor": float(params["factor"])}


def gpt_config(hf_config, **overrides: Any):
    """The Megatron TransformerConfig of an HF config (fp32 parameters, no dropout: the settings under which
    Megatron and HF logits agree to fp32 rounding; each fusion on where the installed stack has its kernel,
    `qurl_mcore.stack.fusions`, none on the CPU). `overrides` replace any field."""
    hf = load_hf_config(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    arch = architecture(hf)
    c = arch.config(hf.to_dict())
    have = arch.features(c)
    if arch.moe and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1
                     or c.get("moe_layer_freq", 1) != 1):
        raise NotImplementedError(f"{arch.model_type} with dense layers (mlp_only_layers, decoder_sparse_step > 1)")
    if c.get("sliding_window") and c.get("use_sliding_window", True):  # Megatron would attend to everything
        raise NotImplementedError(f"sliding-window attention (sliding_window {c['sliding_window']}) is not "
                                  "supported; use a checkpoint whose config has sliding_window null")
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
        **{name: on for name, (on, _) in fusions(Stack.installed()).items()},
    )
    if arch.moe:
        shape = Shape.of(c, have)
        kw.update(
            num_moe_experts=shape.experts,
            moe_router_topk=shape.topk,
            moe_ffn_hidden_size=shape.moe_intermediate,
            moe_router_pre_softmax=not c["norm_topk_prob"],
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
        if "shared_experts" in have:  # output + sigmoid(w·x)·shared(x) with the gate, output + shared(x) without
            kw.update(moe_shared_expert_intermediate_size=shape.shared_intermediate,
                      moe_shared_expert_gate="shared_expert_gate" in have)
    if "sigmoid_router" in have:
        kw.update(_sigmoid_router(c))
    if "mla" in have:
        kw.update(_mla(c))
    kw.update(overrides)
    return (MLATransformerConfig if "mla" in have else TransformerConfig)(**kw)


def _sigmoid_router(c: dict[str, Any]) -> dict[str, Any]:
    """Megatron's router settings for DeepSeek-V3's noaux_tc routing (module docstring). Megatron scores an
    expert group by the sum of its top topk/topk_group scores, HF by its top 2: configs where these differ are
    refused, as is a sigmoid router without renormalisation (Megatron always renormalises a sigmoid top-k)."""
    groups, group_topk, topk = c.get("n_group") or 1, c.get("topk_group") or 1, c["num_experts_per_tok"]
    if groups > 1 and topk // group_topk != 2:
        raise NotImplementedError(f"num_experts_per_tok {topk} with topk_group {group_topk}: Megatron scores a group "
                                  f"by its top {topk // group_topk} experts, HF by its top 2; use topk = 2·topk_group")
    if not c.get("norm_topk_prob", True):
        raise NotImplementedError("a sigmoid router with norm_topk_prob false: Megatron renormalises the top-k")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        raise NotImplementedError(f"topk_method {c['topk_method']!r}; Megatron builds DeepSeek-V3's 'noaux_tc'")
    dense = c.get("first_k_dense_replace") or 0
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0, moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
                moe_layer_freq=[0] * dense + [1] * (c["num_hidden_layers"] - dense))


def _mla(c: dict[str, Any]) -> dict[str, Any]:
    """MLATransformerConfig's fields for a DeepSeek-V3 config: RoPE on interleaved pairs, as Megatron's MLA reads
    them, plain or YaRN-scaled (DeepSeek-V3's own: `_yarn`); other RoPE types and a model without q's low rank
    are refused."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise NotImplementedError(f"MLA with RoPE type {kind!r}: 'default' and 'yarn' are checked against "
                                  "transformers; use a checkpoint with one of them")
    if not c.get("rope_interleave", True):
        raise NotImplementedError("MLA with rope_interleave false: Megatron's MLA reads interleaved RoPE pairs")
    if not c.get("q_lora_rank"):
        raise NotImplementedError("MLA without q_lora_rank (DeepSeek-V2-Lite's q_proj) is not in the table")
    return dict(multi_latent_attention=True, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
                v_head_dim=c["v_head_dim"], kv_channels=c["v_head_dim"],
                rotary_base=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), qk_layernorm=True,
                num_query_groups=c["num_attention_heads"], **(_yarn(c, rope) if kind == "yarn" else {"rope_type": "rope"}))


def _yarn(c: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """Megatron's YaRN fields for DeepSeek-V3's RoPE scaling, read as transformers reads them
    (`_compute_yarn_parameters`): the factor, else max_position_embeddings / original_max_position_embeddings;
    both scale the softmax by mscale(factor, mscale_all_dim)² and the rotary cos/sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or c["max_position_embeddings"] / original)
    if rope.get("mscale") not in (None, 1, 1.0) and not rope.get("mscale_all_dim"):
        # transformers then drops mscale from the cos/sin factor; Megatron keeps it
        raise NotImplementedError(f"YaRN with mscale {rope['mscale']} and no mscale_all_dim: transformers and "
                                  "Megatron scale the rotary embedding differently there")
    return dict(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                mscale=float(rope.get("mscale", 1)), mscale_all_dim=float(rope.get("mscale_all_dim", 0)))


#: train.recompute -> Megatron's activation recomputation settings
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},  # core attention: the s x s part
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def build_gpt(
    hf_config, *, recipe: Recipe | None = None, dtype: torch.dtype = torch.float32, recompute: str = "none",
    core_attention: str | None = None, experts: str | None = None, **overrides: Any
):
    """A randomly initialised GPTModel shaped like `hf_config` (object or checkpoint dir), its linears
    following the trainer side of `recipe` (`qurl_mcore.recipe.resolve`; None: full precision; see
    `gpt_spec`), its parameters `dtype` on the current device (the CUDA device when there is one), recomputing
    activations as `recompute` says (`RECOMPUTE`), with the core attention `core_attention`
    (`spec.CORE_ATTENTION`; by default SDPA on CUDA, Megatron's local one on the CPU), the routed experts as
    `experts` (`spec.EXPERT_MODULES`; by default `qurl_mcore.stack.experts`'s choice). Load weights with
    `convert.load_hf_weights`. FP8 training on Transformer Engine (`Recipe.te`) gets Megatron's fp8 settings."""
    recipe = as_recipe(recipe)
    hf = load_hf_config(hf_config)
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; use one of {list(RECOMPUTE)}")
    if recipe.te:
        overrides = {"fp8": "e4m3", "fp8_recipe": "tensorwise", **overrides}
    overrides = {"params_dtype": dtype, "pipeline_dtype": dtype, "bf16": dtype == torch.bfloat16,
                 "use_cpu_initialization": not torch.cuda.is_available(), **RECOMPUTE[recompute], **overrides}
    config = gpt_config(hf, **overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_spec(config, recipe, core_attention=core_attention, experts=experts),
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        rotary_percent=float(_rope_parameters(hf).get("partial_rotary_factor",
                                                      getattr(hf, "partial_rotary_factor", None) or 1.0)),
        **rope_scaling(hf),
    )
    if torch.cuda.is_available():  # torch-built norms and the router come on the CPU in fp32: every parameter on
        for param in model.parameters():  # the GPU in `dtype`, as in Megatron's Float16Module
            param.data = param.data.to(device=torch.cuda.current_device(), dtype=dtype)
    return model
