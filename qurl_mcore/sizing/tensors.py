"""The model's tensors: a model's config.json (`model_config`; its `Shape` is `qurl_mcore.models.registry.shape`)
and every tensor of the model, from its architecture table, in the order the weight push streams them
(`hf_tensors`). A quantized weight's bytes are its format's (`qurl_mcore.quant.formats.FormatSpec.weight_bytes`).

Notation: h hidden, i intermediate (i_m per expert, i_s shared expert), L layers, a attention heads, g key-value
heads, d head dim, V vocabulary, E experts, k experts per token.

Parameters, counted exactly from the shape (`hf_tensors`, in the order the weight push streams them):
embedding V·h, lm_head V·h (untied), per layer q h·a·d, k and v h·g·d each (+ a·d, g·d, g·d biases for Qwen2),
o a·d·h, q/k norms d each (Qwen3), two norms h, a dense SwiGLU MLP 3·h·i, or a router E·h and E experts of
3·h·i_m (+ a shared expert 3·h·i_s; + E for DeepSeek-V3's router expert bias, a buffer the checkpoint holds), and
the final norm h. Under MLA (DeepSeek-V3) the attention is q_a h·r_q, its norm r_q, q_b r_q·a·(d_n+d_r), kv_a
h·(r_kv+d_r), its norm r_kv, kv_b r_kv·a·(d_n+d_v), o a·d_v·h; MoE models with `first_k_dense_replace` have a dense
MLP in those first layers and MoE in the others."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import resolve_model_path
from ..models.cards import card
from ..models.registry import ARCHITECTURES
from ..models.slots import Shape, Slot
from ..precision import quantized_linears


_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # rollout.dtype


@dataclass(frozen=True)
class Tensor:
    """One HF tensor: its name, shape, layer (None: embedding, final norm, lm_head) and kind, the group of its
    slot in the architecture table (`qurl_mcore.models.slots.GROUPS`), which says how it is sharded: vocab rows
    (embedding, output), replicated (norm, router), over TP (attention with its biases, mlp, shared_experts)
    or over EP and ETP (experts). `fp32`: the tensor stays fp32 whatever rollout.dtype (`Slot.fp32`, the router's
    expert bias: `megatron.convert.export_cast`). `columns`: a row-parallel linear's weight (`Slot.layout`
    "columns"), which TP ranks split along its columns."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    kind: str
    fp32: bool = False
    columns: bool = False

    def bytes(self, dtype_bytes: int) -> int:
        """Its bytes in a push or an engine whose rollout.dtype has `dtype_bytes` a value."""
        return self.numel * (4 if self.fp32 else dtype_bytes)

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


@functools.lru_cache(maxsize=64)
def _quantized(s: Shape, precision: str, scope: str, side: str) -> frozenset[str]:
    """HF weight names `precision.quantized_linears` gives for this shape (cached: MoE models have 10^4+)."""
    c = {"model_type": s.model_type, "num_hidden_layers": s.layers, "num_experts": s.experts,
         "shared_expert_intermediate_size": s.shared_intermediate, "first_k_dense_replace": s.dense_layers}
    return frozenset(n + ".weight" for n in quantized_linears(c, precision, scope, side))


def _layer_tensors(s: Shape, slots: tuple[Slot, ...], i: int, ep: int) -> list[list[Tensor]]:
    """Layer i's tensors, one list per per-layer slot of the architecture table (its export order; empty where
    the slot is not in layer i: the MoE slots of a dense layer, the dense MLP of an MoE layer); routed experts in
    the order `megatron.export_hf_weights` yields them under EP: local expert j of each EP rank r."""
    local = s.experts // ep if s.experts else 0
    order = [r * local + j for j in range(local) for r in range(ep)]
    return [[Tensor(t.format(layer=i, expert=e), shape, i, slot.group, slot.fp32, slot.layout == "columns")
             for e in (order if slot.per_expert else [None]) for t, shape in zip(slot.hf, slot.shapes(s))]
            if i in s.slot_layers(slot) else [] for slot in slots if slot.per_layer]


@functools.lru_cache(maxsize=64)
def hf_tensors(s: Shape, pp: int = 1, ep: int = 1) -> tuple[Tensor, ...]:
    """Every HF tensor of the model, in the order `megatron.export_hf_weights` yields them under PP stages and
    EP: stage by stage; within a stage slot by slot (the slots before the layers' on the first stage, each
    per-layer slot over the stage's layers, the slots after the layers' on the last)."""
    if s.layers % pp:
        raise ValueError(f"train.pp_size: {pp} must divide the model's {s.layers} layers")
    slots = tuple(x for x in ARCHITECTURES[s.model_type].slots_with(s.features) if x.exported)
    first = next(k for k, x in enumerate(slots) if x.per_layer)
    ends = [[Tensor(t, shape, None, x.group, x.fp32) for t, shape in zip(x.hf, x.shapes(s))]
            for x in slots if not x.per_layer]
    before, after = ends[:first], ends[first:]
    per = s.layers // pp
    out: list[Tensor] = []
    for stage in range(pp):
        if stage == 0:
            out.extend(t for ts in before for t in ts)
        layers = [_layer_tensors(s, slots, i, ep) for i in range(stage * per, (stage + 1) * per)]
        for rule in range(len(layers[0]) if layers else 0):
            for by_rule in layers:
                out.extend(by_rule[rule])
        if stage == pp - 1:
            out.extend(t for ts in after for t in ts)
    return tuple(out)


def parameter_count(s: Shape) -> int:
    """Parameters of the model (a tied embedding counted once), as `sum(p.numel())` of the HF model."""
    return sum(t.numel for t in hf_tensors(s))
