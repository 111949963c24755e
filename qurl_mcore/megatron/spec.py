"""`gpt_spec`: the GPT block spec (dense or MoE) of a recipe (`qurl_mcore.recipe`), derived from Megatron's
local spec (`get_gpt_layer_local_spec`) by swapping only the linears of the groups the trainer quantizes
(`Recipe.train_groups`). Which Megatron parameter belongs to which linear group is its slot's `group` in the
architecture table (`qurl_mcore.models`); the spec swaps, per group, the Megatron submodules below:

  attention       self_attention's linear_qkv (column) and linear_proj (row); under MLA linear_q_up_proj
                  (column) and linear_proj (row), its latent projections never (`latent`: the down
                  projections and linear_kv_up_proj)
  mlp, experts,   the MLP's linear_fc1 (column) and linear_fc2 (row): the dense MLP, every routed expert's,
  shared_experts  the shared experts'
Routers, norms, embeddings and the output layer are never quantized (GPTModel builds the last two itself).
A precision that trains in full precision (bf16, and QuRL's int8/fp8) keeps every stock linear.

The core attention is one of `CORE_ATTENTION`: torch's fused SDPA (attention.py; the default on CUDA, and
what `qurl plan` sizes) or Megatron's unfused local one (the default on the CPU, bitwise the stock spec).
The routed experts are one of `EXPERT_MODULES`: grouped GEMMs over the same parameters (grouped_experts.py;
the default) or Megatron's SequentialMLP, one expert after another (`qurl_mcore.stack.experts` says which and
why).
"""
from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl, TransformerBlockSubmodules, get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from qurl_mcore.models.registry import megatron_slot
from qurl_mcore.recipe import Recipe, resolve, te_fp8_available
from qurl_mcore.stack import experts as default_experts

from .attention import SDPAttention
from .grouped_experts import GroupedExperts
from .layers import QuantColumnParallelLinear, QuantRowParallelLinear, SequenceParallelNorm


def linear_group(param_name: str) -> str | None:
    """The linear group (`qurl_mcore.models.slots.LINEAR_GROUPS`) of a Megatron weight, None for weights no scope
    quantizes (router, norms, embedding, output layer, biases)."""
    slot = megatron_slot(param_name)
    return slot.group if slot is not None and slot.quantizable else None


def quantized_linears(model, hf_config) -> set[str]:
    """HF module names (without `.weight`) of the linears this rank's `model` quantizes: the ones built
    from a quantized spec (`gpt_spec`), compare `qurl_mcore.precision.quantized_linears`."""
    # here, not at the top: convert.py imports gpt.py, which imports this module
    from .convert import hf_names

    kinds: tuple[type, ...] = (QuantColumnParallelLinear, QuantRowParallelLinear)
    if te_fp8_available():
        # Transformer Engine only when it runs the GEMMs (absent on CPUs)
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        kinds += (TEColumnParallelLinear, TERowParallelLinear)
    return {hf.removesuffix(".weight") for name, module in model.named_modules()
            if isinstance(module, kinds) and (not hasattr(module, "quant") or module.quant.quantized)
            for hf in hf_names(model, hf_config, f"{name}.weight")}


#: core attention name -> its module (None: keep the local spec's DotProductAttention)
CORE_ATTENTION: dict[str, type | None] = {"local": None, "sdpa": SDPAttention}


def _latent(core: type) -> type:
    """`core` as MLA's core attention: Megatron 0.16.1's MLA passes k_channels and v_channels (q·k and v widths),
    which only Transformer Engine's attention takes; the local and SDPA ones compute with any widths and size
    their output by kv_channels, which `gpt_config` sets to v_head_dim under MLA."""
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        if v_channels is not None and v_channels != kwargs.get("config", args[0] if args else None).kv_channels:
            raise ValueError(f"MLA core attention: v_channels {v_channels} must equal config.kv_channels")
        core.__init__(self, *args, **kwargs)

    return type(f"Latent{core.__name__}", (core,), {"__init__": __init__, "__doc__": _latent.__doc__})


#: core attention name -> MLA's core attention module
MLA_CORE_ATTENTION: dict[str, type] = {"local": _latent(DotProductAttention), "sdpa": _latent(SDPAttention)}


#: `stack.EXPERTS` name -> the module of an MoE layer's routed experts (both build SequentialMLP's parameters)
EXPERT_MODULES: dict[str, type] = {"grouped": GroupedExperts, "sequential": SequentialMLP}


def default_attention() -> str:
    return "sdpa" if torch.cuda.is_available() else "local"


def as_recipe(recipe: Recipe | None) -> Recipe:
    """`recipe`, or full precision for None; a precision's name is refused (resolve it once, where the model
    is built, and pass the recipe on)."""
    if recipe is None:
        return resolve("bf16")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"expected a Recipe, got {recipe!r}: pass qurl_mcore.recipe.resolve(precision, scope, fmt)")
    return recipe


def _linears(recipe: Recipe) -> tuple[object, object]:
    """(column, row) linear specs of a recipe that trains quantized."""
    if recipe.te:  # TE kernels under Megatron's fp8_autocast
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        return TEColumnParallelLinear, TERowParallelLinear
    return (ModuleSpec(module=QuantColumnParallelLinear, params={"quant": recipe.train}),
            ModuleSpec(module=QuantRowParallelLinear, params={"quant": recipe.train}))


def _check_config(config: TransformerConfig, recipe: Recipe) -> None:
    if recipe.te and config.fp8 is None:
        raise ValueError(f"precision {recipe.precision.name!r} on Transformer Engine needs config.fp8='e4m3' and "
                         "config.fp8_recipe='tensorwise' so that Megatron enters fp8_autocast")
    if config.num_moe_experts and config.moe_grouped_gemm:
        raise ValueError("gpt_spec picks the experts module itself (gpt_spec(experts=...)); moe_grouped_gemm "
                         "selects Megatron's own, whose parameters the HF conversion does not map: set it False")


def gpt_spec(config: TransformerConfig, recipe: Recipe | None = None,
             core_attention: str | None = None, experts: str | None = None) -> TransformerBlockSubmodules:
    """The GPT block spec for `config` with the trainer side of `recipe` (None: full precision) applied to the
    linears of its `train_groups`. Pass the result as `GPTModel(transformer_layer_spec=...)`. A
    full-precision trainer gets Megatron's local spec (apart from the norm under sequence parallelism, which
    the stock torch norm refuses, and the experts module). `core_attention`: a key of `CORE_ATTENTION`, by
    default `default_attention()`; `experts`: a key of `EXPERT_MODULES`, by default `stack.experts(recipe)`'s."""
    recipe = as_recipe(recipe)
    _check_config(config, recipe)
    core_attention = core_attention or default_attention()
    if core_attention not in CORE_ATTENTION:
        raise ValueError(f"core_attention {core_attention!r} is not one of {list(CORE_ATTENTION)}")
    experts = experts or default_experts(recipe)[0]
    if experts not in EXPERT_MODULES:
        raise ValueError(f"experts {experts!r} is not one of {list(EXPERT_MODULES)}")
    moe = _layer(config, recipe, core_attention, config.num_moe_experts, EXPERT_MODULES[experts]) \
        if config.num_moe_experts else None
    dense = _layer(config, recipe, core_attention, None)
    pattern = _moe_pattern(config)
    offset = get_transformer_layer_offset(config)
    layers = [moe if pattern[offset + i] else dense for i in range(get_num_layers_to_build(config))]
    final_norm = SequenceParallelNorm if config.sequence_parallel else LayerNormImpl  # LayerNormImpl: what
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)  # TransformerBlock's default


def _moe_pattern(config: TransformerConfig) -> list[int]:
    """1 for each MoE layer of the model, 0 for each dense one (Megatron's moe_layer_freq: every layer MoE, or
    a list, DeepSeek-V3's first dense layers)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]


def _layer(config: TransformerConfig, recipe: Recipe, core_attention: str, num_experts: int | None,
           experts: type = SequentialMLP) -> ModuleSpec:
    """One layer's spec: Megatron's local spec (with MLA where the config has it; an MoE MLP for `num_experts`
    with `experts` as its routed experts), the stock torch norms swapped for sequence-parallel ones under SP, the
    linears of the recipe's train groups swapped for quantized ones."""
    mla = bool(config.multi_latent_attention)
    layer = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
        multi_latent_attention=mla, normalization=config.normalization,
    )
    sub = layer.submodules
    if num_experts:
        sub.mlp.submodules.experts.module = experts
    attention = sub.self_attention.submodules
    if mla:
        attention.core_attention = MLA_CORE_ATTENTION[core_attention]
    elif CORE_ATTENTION[core_attention] is not None:
        attention.core_attention = CORE_ATTENTION[core_attention]
    if config.sequence_parallel:
        sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelNorm
        if config.qk_layernorm and mla:
            attention.q_layernorm = attention.kv_layernorm = SequenceParallelNorm
        elif config.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    if recipe.train_groups:
        column, row = _linears(recipe)
        slots = {"attention": [attention]}
        if num_experts:
            slots["experts"] = [sub.mlp.submodules.experts.submodules]
            slots["shared_experts"] = [sub.mlp.submodules.shared_experts.submodules]
        else:
            slots["mlp"] = [sub.mlp.submodules]
        for group, subs in slots.items():
            if group not in recipe.train_groups:
                continue
            for s in subs:
                if group == "attention" and mla:  # the latent projections (group "latent") never
                    s.linear_q_up_proj, s.linear_proj = column, row
                elif group == "attention":
                    s.linear_qkv, s.linear_proj = column, row
                else:
                    s.linear_fc1, s.linear_fc2 = column, row
    return layer
