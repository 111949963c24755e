"""`gpt_spec`: the GPT block spec (dense or MoE) of a precision recipe and scope, derived from Megatron's
local spec (`get_gpt_layer_local_spec`) by swapping only the linears the scope names.

Scopes:
  experts — the routed experts' fc1/fc2 (MoEResQ's default). A dense model's MLP is its one "expert", so
            for dense models this scope means the MLP.
  all     — additionally the attention projections (linear_qkv, linear_proj) and any shared experts.
Routers, norms, embeddings and the output layer are never quantized (GPTModel builds the last two itself).
"""
from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from .layers import QuantColumnParallelLinear, QuantRowParallelLinear, SequenceParallelNorm
from .recipes import SCOPES, linear_spec, te_fp8_available


def _linears(recipe: str, fmt: str | None) -> tuple[object, object]:
    """(column, row) linear specs of a quantized recipe."""
    if recipe == "fp8" and te_fp8_available():  # GPU: TE kernels, under the fp8_autocast Megatron enters
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        return TEColumnParallelLinear, TERowParallelLinear
    quant = linear_spec(recipe, fmt)
    return (ModuleSpec(module=QuantColumnParallelLinear, params={"quant": quant}),
            ModuleSpec(module=QuantRowParallelLinear, params={"quant": quant}))


def _check_config(config: TransformerConfig, recipe: str) -> None:
    if recipe == "fp8" and te_fp8_available() and config.fp8 is None:
        raise ValueError("recipe 'fp8' on Transformer Engine needs config.fp8='e4m3' and "
                         "config.fp8_recipe='tensorwise' so that Megatron enters fp8_autocast")
    if config.num_moe_experts and config.moe_grouped_gemm:
        raise ValueError("gpt_spec builds SequentialMLP experts; set moe_grouped_gemm=False")


def gpt_spec(
    config: TransformerConfig, recipe: str = "bf16", scope: str = "experts", fmt: str | None = None
) -> TransformerBlockSubmodules:
    """The GPT block spec for `config` with `recipe` applied to the linears `scope` selects.

    Pass the result as `GPTModel(transformer_layer_spec=...)`. Recipe `bf16` is Megatron's local spec
    unchanged (apart from the norm under sequence parallelism, which the stock torch norm refuses).
    """
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; use one of {list(SCOPES)}")
    linear_spec(recipe, fmt)  # validate the recipe and format whatever the backend
    _check_config(config, recipe)
    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm, normalization=config.normalization,
    )
    sub = layer.submodules
    attention = sub.self_attention.submodules
    final_norm = LayerNormImpl  # what TransformerBlock uses for its final norm when given a layer spec
    if config.sequence_parallel:
        final_norm = sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelNorm
        if config.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    if recipe != "bf16":
        column, row = _linears(recipe, fmt)
        ffn = sub.mlp.submodules.experts.submodules if config.num_moe_experts else sub.mlp.submodules
        ffn.linear_fc1, ffn.linear_fc2 = column, row
        if scope == "all":
            attention.linear_qkv, attention.linear_proj = column, row
            if config.num_moe_experts:
                shared = sub.mlp.submodules.shared_experts.submodules
                shared.linear_fc1, shared.linear_fc2 = column, row
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=final_norm)
