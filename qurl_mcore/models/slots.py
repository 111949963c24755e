"""The types of an architecture table: where each weight of a model family lives on each side, and what it is.

A `Slot` is one Megatron parameter and the HF tensors it is made of, with everything a part of the project needs
to know about it:

  megatron   the Megatron parameter (template with `{layer}` and, for routed experts, `{expert}`)
  hf         the HF tensors it merges, in merge order (same placeholders)
  layout     how those merge into Megatron's full tensor and how that is sharded (tensor/expert parallel):
               replicated  one HF tensor, every rank holds all of it          (norms, router)
               rows        one HF tensor, split along dim 0                    (embedding, output layer)
               columns     one HF tensor, split along dim 1                    (row-parallel linears)
               qkv         q, k, v interleaved per query group:                (linear_qkv weight and bias)
                           [q_g, k_g, v_g] for g = 0..groups-1, then split along dim 0 (whole groups per rank)
               gate_up     [gate; up], each half split along dim 0             (SwiGLU's fc1)
             expert slots are sharded over the expert-tensor-parallel group and live on the expert-parallel
             rank that owns them
  group      what it is: embedding, norm, attention, latent (MLA's projections to its low-rank q and kv and
             from the kv latent, kept in full precision on both sides), mlp, experts, shared_experts, router,
             output; the linear
             groups a precision's scope can quantize are `LINEAR_GROUPS`
  shapes     the HF tensors' shapes from the config's `Shape` (what `qurl plan` counts)
  sglang     the SGLang module that holds these HF tensors (SGLang packs q/k/v and gate/up as Megatron does),
             for linears a scope can quantize; a routed expert's is the layer's FusedMoE; or one module per HF
             tensor (a tuple), where SGLang builds a linear of each (Mixtral's experts under a quantization)
  uaq        the UAQ role of each HF tensor (`qurl_mcore.uaq.UAQ_EXPONENTS`), None for tensors UAQ leaves alone
  needs      the config feature this slot exists under ("" = always; see `Architecture.features`)
  exported   False for a copy of a tensor another slot exports (a tied output layer under pipeline stages)
  layers     the layers a per-layer slot exists in: "all", "dense" (a dense model's every layer, an MoE model's
             first `first_k_dense_replace`), or "moe" (the others)
  fp32       True for a tensor that stays fp32 whatever dtype the weights travel or are written in (the router's
             expert bias: Megatron and SGLang hold it in fp32, and a bf16 copy moves near-tie routes)

An `Architecture` is a model type's slots and the features its configs turn on. Nothing here imports a framework:
the converter, the trainer's spec, the SGLang plugin, UAQ, the precision table and `qurl plan` read these tables.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

LAYOUTS = ("replicated", "rows", "columns", "qkv", "gate_up")
GROUPS = ("embedding", "norm", "attention", "latent", "mlp", "experts", "shared_experts", "router", "output")
#: the groups whose weights a precision's scope can quantize (routers, norms, MLA's latent down projections,
#: embedding, output never)
LINEAR_GROUPS = ("attention", "mlp", "experts", "shared_experts")


@dataclass(frozen=True)
class Shape:
    """The fields of an HF config.json that size a model, and the features its architecture gives it
    (`Architecture.features`)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    topk: int
    moe_intermediate: int
    shared_intermediate: int
    features: frozenset[str]
    dense_layers: int = 0  # the first layers with a dense MLP (every layer of a dense model)
    q_lora_rank: int = 0  # MLA (DeepSeek-V3): q's low rank, the latent kv's rank and the decoupled RoPE key's
    kv_lora_rank: int = 0  # width; head_dim is then the q·k width (qk_nope_head_dim + qk_rope_head_dim)
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def of(cls, hf: Mapping[str, Any], features: frozenset[str]) -> Shape:
        h, a = hf["hidden_size"], hf["num_attention_heads"]
        mla = "mla" in features
        return cls(
            model_type=hf.get("model_type", ""), hidden=h, intermediate=hf.get("intermediate_size", 0),
            layers=hf["num_hidden_layers"], heads=a, kv_heads=a if mla else hf.get("num_key_value_heads") or a,
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] if mla else hf.get("head_dim") or h // a,
            vocab=hf["vocab_size"], experts=config_experts(hf), topk=hf.get("num_experts_per_tok") or 0,
            moe_intermediate=hf.get("moe_intermediate_size") or 0,
            shared_intermediate=hf.get("shared_expert_intermediate_size") or 0, features=features,
            dense_layers=dense_layers(hf), q_lora_rank=hf.get("q_lora_rank") or 0 if mla else 0,
            kv_lora_rank=hf["kv_lora_rank"] if mla else 0, qk_rope_head_dim=hf["qk_rope_head_dim"] if mla else 0,
            v_head_dim=hf["v_head_dim"] if mla else 0)

    @property
    def tied(self) -> bool:
        return "tied" in self.features

    @property
    def qk_norm(self) -> bool:
        return "qk_norm" in self.features

    @property
    def mla(self) -> bool:
        return "mla" in self.features

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV cache per token: 2 (k, v) · L · g · d · bytes, per GPU of a TP engine (g/TP heads, at least one).
        MLA caches per layer the compressed latent (kv_lora_rank) and the decoupled RoPE key (qk_rope_head_dim),
        shared by every head, so each TP rank holds all of it: L · (kv_lora_rank + qk_rope_head_dim) · bytes."""
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes

    def slot_layers(self, slot: Slot) -> range:
        """The layers `slot` (a per-layer slot) exists in."""
        return slot.layer_range(self.layers, self.dense_layers)


def config_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts of an MoE config.json (0: dense); transformers 5 writes Qwen3-MoE's as num_local_experts,
    DeepSeek-V3 and GLM-4.5 as n_routed_experts."""
    return hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0


def dense_layers(hf: Mapping[str, Any]) -> int:
    """The first layers whose MLP is dense: every layer of a dense model, an MoE model's first
    `first_k_dense_replace` (DeepSeek-V3, GLM-4.5; 0 where the config has none)."""
    return hf.get("first_k_dense_replace") or 0 if config_experts(hf) else hf["num_hidden_layers"]


#: Slot.layers -> the layers of a model with L layers, the first k of them dense, that the slot exists in
LAYER_KINDS: dict[str, Callable[[int, int], range]] = {
    "all": lambda n, k: range(n), "dense": lambda n, k: range(k), "moe": lambda n, k: range(k, n)}


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter and its HF tensors (module docstring)."""

    megatron: str
    hf: tuple[str, ...]
    layout: str
    group: str
    shapes: Callable[[Shape], tuple[tuple[int, ...], ...]]
    sglang: str | tuple[str, ...] | None = None
    uaq: tuple[str | None, ...] = ()
    needs: str = ""
    exported: bool = True
    layers: str = "all"
    fp32: bool = False

    def __post_init__(self) -> None:
        if self.layers not in LAYER_KINDS:
            raise ValueError(f"{self.megatron}: unknown layers {self.layers!r}; use one of {list(LAYER_KINDS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.megatron}: unknown layout {self.layout!r}; use one of {list(LAYOUTS)}")
        if self.group not in GROUPS:
            raise ValueError(f"{self.megatron}: unknown group {self.group!r}; use one of {list(GROUPS)}")
        if self.uaq and len(self.uaq) != len(self.hf):
            raise ValueError(f"{self.megatron}: {len(self.uaq)} UAQ roles for {len(self.hf)} HF tensors")
        if isinstance(self.sglang, tuple) and len(self.sglang) != len(self.hf):
            raise ValueError(f"{self.megatron}: {len(self.sglang)} SGLang modules for {len(self.hf)} HF tensors")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    def layer_range(self, n_layers: int, n_dense: int) -> range:
        """The layers of a model with `n_layers`, the first `n_dense` dense, this per-layer slot exists in."""
        return LAYER_KINDS[self.layers](n_layers, n_dense)

    def sglang_modules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(SGLang module, the HF tensors it holds) of this slot: one module for all of them, or one each."""
        if self.sglang is None:
            return ()
        if isinstance(self.sglang, str):
            return ((self.sglang, self.hf),)
        return tuple((module, (t,)) for module, t in zip(self.sglang, self.hf))

    @property
    def quantizable(self) -> bool:
        """A linear weight a scope can quantize (biases and everything outside `LINEAR_GROUPS` never)."""
        return self.group in LINEAR_GROUPS and self.megatron.endswith(".weight")


def pattern(template: str) -> re.Pattern:
    """A name template as a regex matching the whole name, with named groups `layer` and `expert`."""
    return re.compile(re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)")
                      .replace(r"\{expert\}", r"(?P<expert>\d+)") + "$")


@dataclass(frozen=True, eq=False)  # one object per model type: identity is equality (and the cache key)
class Architecture:
    """A model type's slots (in export order: embedding, per-layer slots, final norm, output layer) and the
    features of its configs. `always` are features every config of the type has; the others are read from the
    config: `tied`/`untied` (tie_word_embeddings), `qkv_bias` (attention_bias), `qk_norm` (use_qk_norm),
    `shared_experts` (shared_expert_intermediate_size). `implied` are config fields this type's config.json leaves out and its
    model code takes as given (Mixtral always renormalises the top-k: norm_topk_prob True); `aliases` name the
    field that holds another's value in this type's configs (Mixtral's experts are `intermediate_size` wide:
    moe_intermediate_size -> intermediate_size; Qwen2-MoE's q/k/v biases are `qkv_bias`); `computed` derive a field
    from the others (DeepSeek-V3's shared_expert_intermediate_size is n_shared_experts · moe_intermediate_size).
    `tiny` are the
    transformers config arguments of `tiny-<model_type>`, the 2-layer random model tests use (besides the
    common ones of `qurl_mcore.models.tiny`)."""

    model_type: str
    slots: tuple[Slot, ...]
    always: frozenset[str] = frozenset()
    tiny: Mapping[str, Any] | None = None
    implied: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    computed: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)

    def config(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """`hf` (a config.json as a dict) with the fields this type implies or names otherwise filled in."""
        hf = {**self.implied, **{k: hf[v] for k, v in self.aliases.items() if v in hf}, **hf}
        return {**hf, **{k: f(hf) for k, f in self.computed.items() if k not in hf}}

    def features(self, hf: Mapping[str, Any]) -> frozenset[str]:
        hf = self.config(hf)
        read = {"tied" if hf.get("tie_word_embeddings", False) else "untied"}
        if hf.get("attention_bias", False):
            read.add("qkv_bias")
        if hf.get("use_qk_norm", False):
            read.add("qk_norm")
        if hf.get("shared_expert_intermediate_size"):
            read.add("shared_experts")
        return self.always | read

    def slots_of(self, hf: Mapping[str, Any]) -> tuple[Slot, ...]:
        """The slots a config of this type has (those whose feature it has)."""
        return self.slots_with(self.features(hf))

    def slots_with(self, features: frozenset[str]) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if not s.needs or s.needs in features)

    @property
    def moe(self) -> bool:
        return any(s.per_expert for s in self.slots)
