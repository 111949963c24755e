"""The architectures qurl-mcore trains and rolls out, by HF `model_type`, and the lookups every part makes in
their tables (`slots.py` says what a table holds). Adding an architecture is one table file and one entry in
`ARCHITECTURES`.

Lookups by config: `architecture`, `slots`, `features`, `shape`, `num_experts`, `hf_linears`. Lookups by name alone (a Megatron parameter, an HF tensor, an SGLang module), across
every registered table: `megatron_slot`, `hf_uaq_role`, `sglang_linears`; a name two tables would read
differently is refused when the index is built.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .deepseek_v3 import DEEPSEEK_V3
from .glm4_moe import GLM4_MOE
from .llama import LLAMA, QWEN2, QWEN3
from .mixtral import MIXTRAL
from .qwen3_moe import QWEN2_MOE, QWEN3_MOE
from .slots import Architecture, Shape, Slot, config_experts, dense_layers, pattern

#: HF model_type -> its table
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL,
                                                                      QWEN2_MOE, DEEPSEEK_V3, GLM4_MOE)}


def config_dict(hf_config: Any) -> dict[str, Any]:
    """An HF config as a dict: a checkpoint directory's config.json, a dict, or a transformers config."""
    if isinstance(hf_config, (str, Path)):
        return json.loads((Path(hf_config) / "config.json").read_text())
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return hf_config.to_dict()


def architecture(hf_config: Any) -> Architecture:
    """The table of a config's model_type; an unsupported one is refused with the supported list."""
    model_type = config_dict(hf_config).get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; use one of {list(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def slots(hf_config: Any) -> tuple[Slot, ...]:
    """The slots of this config (its architecture's, less those of features it lacks), in export order."""
    c = config_dict(hf_config)
    return architecture(c).slots_of(c)


def features(hf_config: Any) -> frozenset[str]:
    c = config_dict(hf_config)
    return architecture(c).features(c)


def shape(hf_config: Any) -> Shape:
    c = config_dict(hf_config)
    arch = architecture(c)
    return Shape.of(arch.config(c), arch.features(c))


def num_experts(hf_config: Any) -> int:
    """Routed experts of a model (0: dense)."""
    return config_experts(config_dict(hf_config))


def hf_linears(hf_config: Any) -> dict[str, str]:
    """HF module name (without `.weight`) -> linear group, for every weight of the model a scope can quantize."""
    c = config_dict(hf_config)
    n_dense = dense_layers(architecture(c).config(c))
    out: dict[str, str] = {}
    for slot in slots(c):
        if not slot.quantizable:
            continue
        for layer in slot.layer_range(c["num_hidden_layers"], n_dense) if slot.per_layer else [None]:
            for expert in range(config_experts(c)) if slot.per_expert else [None]:
                out.update({t.format(layer=layer, expert=expert).removesuffix(".weight"): slot.group
                            for t in slot.hf})
    return out


@functools.lru_cache(maxsize=8)
def _index(archs: tuple[Architecture, ...]) -> dict[str, list[tuple[re.Pattern, Any]]]:
    """Name patterns of every table: Megatron parameter -> slot, HF tensor -> UAQ role, SGLang module -> the
    slots it holds. Tables may give one Megatron parameter different HF names, never a different group, layout
    or UAQ roles; an HF or SGLang name means one thing in every table."""
    megatron: dict[str, Slot] = {}
    hf: dict[str, str | None] = {}
    sglang: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {}
    for arch in archs:
        held: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {}  # module -> (group, HF tensors) of its slots
        for slot in arch.slots:
            if not slot.exported:
                continue
            _agree(megatron, slot.megatron, slot, arch, lambda s: (s.group, s.layout, s.uaq))
            for template, role in zip(slot.hf, slot.uaq or (None,) * len(slot.hf)):
                _agree(hf, template, role, arch)
            for module, tensors in slot.sglang_modules():
                held[module] = held.get(module, ()) + ((slot.group, tensors),)
        for template, these in held.items():
            _agree(sglang, template, these, arch)
    # search (not match): a Megatron name may carry a wrapper's prefix ("module."), an SGLang one its model's
    return {"megatron": [(re.compile(r"(?:^|\.)" + pattern(t).pattern), s) for t, s in megatron.items()],
            "hf": [(pattern(t), r) for t, r in hf.items() if r is not None],
            "sglang": [(re.compile(r"(?:^|\.)" + pattern(t).pattern), s) for t, s in sglang.items()]}


def _agree(table: dict, key: str, value: Any, arch: Architecture, meaning=lambda v: v) -> None:
    if key in table and meaning(table[key]) != meaning(value):
        raise ValueError(f"architecture {arch.model_type!r} gives {key} another meaning than an earlier table")
    table.setdefault(key, value)


def _lookup(kind: str, name: str) -> tuple[re.Match, Any] | None:
    for p, value in _index(tuple(ARCHITECTURES.values()))[kind]:
        if m := p.search(name):
            return m, value
    return None


def megatron_slot(param_name: str) -> Slot | None:
    """The slot of a Megatron parameter name (any wrapper prefix), None for a name no table knows."""
    found = _lookup("megatron", param_name)
    return found[1] if found else None


def hf_uaq_role(name: str) -> str | None:
    """The UAQ role of an HF tensor name, None for tensors UAQ leaves alone."""
    found = _lookup("hf", name)
    return found[1] if found else None


def sglang_linears(prefix: str, num_experts: int = 0) -> tuple[str, list[str]] | None:
    """(group, HF module names without `.weight`) of the SGLang module at `prefix` that a scope can quantize
    (a FusedMoE: every routed expert's, `num_experts` of them; one expert's linear: that expert's); None for
    modules no scope quantizes."""
    found = _lookup("sglang", prefix)
    if found is None:
        return None
    m, held = found
    base = prefix[:m.start() + (m.group(0).startswith("."))]  # what the model puts before "model.layers..."
    layer, group = int(m["layer"]), held[0][0]
    fused = "expert" not in m.groupdict() and "{expert}" in held[0][1][0]
    experts = range(num_experts) if fused else [int(m["expert"]) if "expert" in m.groupdict() else None]
    names = [base + t.format(layer=layer, expert=e).removesuffix(".weight")
             for e in experts for _, tensors in held for t in tensors]
    return group, names
