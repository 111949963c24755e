"""The model's tensors and their bytes: the fields of an HF config.json that size a model (`Shape`; `model_config`
reads them), every tensor of the model in the order the weight push streams them (`hf_tensors`), and the bytes
of a quantized weight in each rollout format (`WEIGHT_FORMATS`).

Notation: h hidden, i intermediate (i_m per expert, i_s shared expert), L layers, a attention heads, g key-value
heads, d head dim, V vocabulary, E experts, k experts per token.

Parameters, counted exactly from the shape (`hf_tensors`, in the order the weight push streams them):
embedding V·h, lm_head V·h (untied), per layer q h·a·d, k and v h·g·d each (+ a·d, g·d, g·d biases for Qwen2),
o a·d·h, q/k norms d each (Qwen3), two norms h, a dense SwiGLU MLP 3·h·i, or a router E·h and E experts of
3·h·i_m (+ a shared expert 3·h·i_s), and the final norm h."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import resolve_model_path
from ..models.cards import card
from ..precision import num_experts, quantized_linears


# ---- quantized weight formats ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """Bytes of a quantized [rows, cols] weight: `bits` per element, a `block_scale` byte per `block` elements
    of a row, `row_scale` bytes per row, `tensor_scale` bytes per tensor (`qurl_mcore.quant.quantize` with the
    rollout method's weight granularity; a test checks these against real QTensors)."""

    bits: int
    block: int = 0
    block_scale: int = 0
    row_scale: int = 0
    tensor_scale: int = 0

    def nbytes(self, rows: int, cols: int) -> int:
        blocks = rows * math.ceil(cols / self.block) * self.block_scale if self.block else 0
        return rows * cols * self.bits // 8 + blocks + rows * self.row_scale + self.tensor_scale


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat(8, row_scale=4),  # codes + an fp32 scale per output channel
    "fp8_e4m3": WeightFormat(8, row_scale=4),
    "nvfp4": WeightFormat(4, block=16, block_scale=1, tensor_scale=4),  # E2M1 pairs, E4M3 per 16, fp32 per tensor
    "mxfp4": WeightFormat(4, block=32, block_scale=1),  # E2M1 pairs, E8M0 per 32
}
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # rollout.dtype


# ---- model shape ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One HF tensor: its name, shape, layer (None: embedding, final norm, lm_head) and kind, which says how
    it is sharded: vocab rows (embedding, output), replicated (norm, router), over TP (attention, mlp,
    shared_experts, bias) or over EP and ETP (experts)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_REPLICATED = ("norm", "router")


def model_config(path: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it came from) for `model.path`: the checkpoint's config.json when the
    path exists (or is "smollm2" / "tiny-<arch>"), else the architecture card of its basename."""
    if path == "smollm2" or path.startswith("tiny-"):
        path = str(resolve_model_path(path))
    config = Path(path) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()), str(config)
    try:
        return card(path), f"card {Path(path).name} (qurl_mcore/models/cards.py; {path} is not on this machine)"
    except KeyError as err:
        raise ValueError(err.args[0]) from None


@dataclass(frozen=True)
class Shape:
    """The fields of an HF config.json that size a model."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int
    topk: int
    moe_intermediate: int
    shared_intermediate: int
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, hf: dict[str, Any]) -> Shape:
        h, a = hf["hidden_size"], hf["num_attention_heads"]
        return cls(
            model_type=hf.get("model_type", ""), hidden=h, intermediate=hf.get("intermediate_size", 0),
            layers=hf["num_hidden_layers"], heads=a, kv_heads=hf.get("num_key_value_heads") or a,
            head_dim=hf.get("head_dim") or h // a, vocab=hf["vocab_size"],
            tied=bool(hf.get("tie_word_embeddings", False)), experts=num_experts(hf),
            topk=hf.get("num_experts_per_tok") or 0, moe_intermediate=hf.get("moe_intermediate_size") or 0,
            shared_intermediate=hf.get("shared_expert_intermediate_size") or 0,
            qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=hf.get("model_type") in ("qwen3", "qwen3_moe"))

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV cache per token: 2 (k, v) · L · g · d · bytes, per GPU of a TP engine (g/TP heads, at least one)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


@functools.lru_cache(maxsize=64)
def _quantized(s: Shape, precision: str, scope: str, side: str) -> frozenset[str]:
    """HF weight names `precision.quantized_linears` gives for this shape (cached: MoE models have 10^4+)."""
    c = {"num_hidden_layers": s.layers, "num_experts": s.experts,
         "shared_expert_intermediate_size": s.shared_intermediate}
    return frozenset(n + ".weight" for n in quantized_linears(c, precision, scope, side))


def _layer_tensors(s: Shape, i: int, ep: int) -> dict[str, list[Tensor]]:
    """Layer i's tensors by export rule (`megatron.convert.NAME_TABLE` order)."""
    h, d, a, g = s.hidden, s.head_dim, s.heads, s.kv_heads

    def t(name: str, shape: tuple[int, ...], kind: str) -> Tensor:
        return Tensor(f"model.layers.{i}.{name}", shape, i, kind)

    rules: dict[str, list[Tensor]] = {
        "input_layernorm": [t("input_layernorm.weight", (h,), "norm")],
        "qkv": [t(f"self_attn.{x}_proj.weight", (n * d, h), "attention") for x, n in zip("qkv", (a, g, g))],
        "qkv_bias": [t(f"self_attn.{x}_proj.bias", (n * d,), "bias") for x, n in zip("qkv", (a, g, g))]
        if s.qkv_bias else [],
        "q_norm": [t("self_attn.q_norm.weight", (d,), "norm")] if s.qk_norm else [],
        "k_norm": [t("self_attn.k_norm.weight", (d,), "norm")] if s.qk_norm else [],
        "o_proj": [t("self_attn.o_proj.weight", (h, a * d), "attention")],
        "post_attention_layernorm": [t("post_attention_layernorm.weight", (h,), "norm")],
    }
    if not s.experts:
        i_ = s.intermediate
        rules["fc1"] = [t(f"mlp.{x}_proj.weight", (i_, h), "mlp") for x in ("gate", "up")]
        rules["fc2"] = [t("mlp.down_proj.weight", (h, i_), "mlp")]
        return rules
    im, local = s.moe_intermediate, s.experts // ep
    order = [r * local + j for j in range(local) for r in range(ep)]  # local expert j of each EP rank r
    rules["router"] = [t("mlp.gate.weight", (s.experts, h), "router")]
    rules["experts_fc1"] = [t(f"mlp.experts.{e}.{x}_proj.weight", (im, h), "experts") for e in order
                            for x in ("gate", "up")]
    rules["experts_fc2"] = [t(f"mlp.experts.{e}.down_proj.weight", (h, im), "experts") for e in order]
    if s.shared_intermediate:
        si = s.shared_intermediate
        rules["shared"] = [t(f"mlp.shared_expert.{x}_proj.weight", shape, "shared_experts")
                           for x, shape in (("gate", (si, h)), ("up", (si, h)), ("down", (h, si)))]
    return rules


@functools.lru_cache(maxsize=64)
def hf_tensors(s: Shape, pp: int = 1, ep: int = 1) -> tuple[Tensor, ...]:
    """Every HF tensor of the model, in the order `megatron.export_hf_weights` yields them under PP stages and
    EP: stage by stage; within a stage rule by rule (embedding, each per-layer rule over the stage's layers,
    final norm, lm_head unless tied)."""
    if s.layers % pp:
        raise ValueError(f"train.pp_size: {pp} must divide the model's {s.layers} layers")
    per = s.layers // pp
    out: list[Tensor] = []
    for stage in range(pp):
        if stage == 0:
            out.append(Tensor("model.embed_tokens.weight", (s.vocab, s.hidden), None, "embedding"))
        layers = [_layer_tensors(s, i, ep) for i in range(stage * per, (stage + 1) * per)]
        for rule in layers[0] if layers else ():
            for by_rule in layers:
                out.extend(by_rule[rule])
        if stage == pp - 1:
            out.append(Tensor("model.norm.weight", (s.hidden,), None, "norm"))
            if not s.tied:
                out.append(Tensor("lm_head.weight", (s.vocab, s.hidden), None, "output"))
    return tuple(out)


def parameter_count(s: Shape) -> int:
    """Parameters of the model (a tied embedding counted once), as `sum(p.numel())` of the HF model."""
    return sum(t.numel for t in hf_tensors(s))
