"""HF <-> Megatron weights for every architecture of `qurl_mcore.models`, driven by its table.

Each slot of the table (`qurl_mcore.models.slots`) pairs a Megatron parameter with the HF tensors it is made
of and a *layout* that says how the HF tensors merge into Megatron's full tensor and how that tensor is
sharded over tensor parallelism; expert slots are sharded over the expert-tensor-parallel group instead, and
live on the expert-parallel rank that owns them: Megatron's local expert j on EP rank r is HF expert
r·(experts/EP) + j.

`load_hf_weights` fills a Megatron model from an HF checkpoint (every tensor used, every parameter set);
`export_hf_weights` gathers the shards and yields HF-named tensors in buckets of bounded size, the format
SGLang's weight update takes, optionally UAQ-scaled on the way out.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors import safe_open
from safetensors.torch import load_file

from qurl_mcore.models.registry import architecture, slots
from qurl_mcore.models.slots import Slot, pattern
from qurl_mcore.transfer import buckets, dtype_name
from qurl_mcore.uaq import uaq_scale_hf

from .gpt import load_hf_config


# ---- layouts: merge/split between HF tensors and Megatron's full tensor; shard/unshard over TP ----------

def _qkv_shape(hf_config) -> tuple[int, int, int]:
    hf = load_hf_config(hf_config)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return hf.num_key_value_heads, hf.num_attention_heads // hf.num_key_value_heads, head_dim


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, d: int) -> torch.Tensor:
    """[q_g, k_g, v_g] for each of `groups` query groups (rows of head dim d)."""
    q, k, v = (t.reshape(groups, -1, d, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[3:])


def merge(layout: str, tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    """Megatron's full (TP=1) tensor from the HF tensors of a rule."""
    if layout == "qkv":
        groups, q_per_group, d = _qkv_shape(hf_config)
        return _interleave(*tensors, groups, d)
    if layout == "gate_up":
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor


def split(layout: str, full: torch.Tensor, hf_config) -> list[torch.Tensor]:
    """The HF tensors of a rule from Megatron's full tensor (inverse of `merge`)."""
    if layout == "qkv":
        groups, q_per_group, d = _qkv_shape(hf_config)
        g = full.reshape(groups, q_per_group + 2, d, *full.shape[1:])
        q, k, v = g[:, :q_per_group], g[:, q_per_group], g[:, q_per_group + 1]
        return [t.reshape(-1, *full.shape[1:]).contiguous() for t in (q, k, v)]
    if layout == "gate_up":
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    return [full]


def shard(layout: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` among `size` tensor-parallel ranks."""
    if layout == "replicated" or size == 1:
        return full
    if layout == "gate_up":
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=1 if layout == "columns" else 0)[rank]


def unshard(layout: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's slice (inverse of `shard`)."""
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if layout == "columns" else 0)


# ---- parallel context ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Placement:
    tp_group: object
    etp_group: object
    ep_group: object
    pp_group: object
    ep_rank: int
    local_experts: int
    layer_offset: int  # the HF index of this pipeline stage's first layer
    local_layers: int


def _placement(model) -> _Placement:
    config = model.config
    ep = ps.get_expert_model_parallel_world_size()
    return _Placement(ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                      ps.get_expert_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                      ps.get_expert_model_parallel_rank(), (config.num_moe_experts or 0) // ep,
                      get_transformer_layer_offset(config), len(model.decoder.layers))


def _fill(template: str, layer: int | None, expert: int | None) -> str:
    return template.format(layer=layer, expert=expert)


# ---- HF -> Megatron --------------------------------------------------------------------------------

def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (its *.safetensors files)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _sources(rules: list[tuple[Slot, re.Pattern]], name: str, where: _Placement) -> tuple[Slot, list[str]]:
    """The rule of Megatron parameter `name` (this rank's naming) and the HF tensor names it is made of."""
    match = next(((r, m) for r, p in rules if (m := p.match(name))), None)
    if match is None:
        raise KeyError(f"Megatron parameter {name} has no slot in its architecture table (qurl_mcore.models)")
    rule, m = match
    layer = where.layer_offset + int(m["layer"]) if "layer" in m.groupdict() else None
    expert = where.ep_rank * where.local_experts + int(m["expert"]) if rule.per_expert else None
    return rule, [_fill(t, layer, expert) for t in rule.hf]


def hf_names(model, hf_config, param_name: str) -> list[str]:
    """The HF tensor names Megatron parameter `param_name` of this rank's `model` is made of (an expert
    shard names its global expert)."""
    rules = [(r, pattern(r.megatron)) for r in slots(hf_config)]
    return _sources(rules, param_name, _placement(model))[1]


class _Checkpoint:
    """The tensors of an HF checkpoint directory, opened lazily: a rank reads only the rows or columns it
    owns (safetensors slices are read from the memory-mapped file, not the whole tensor)."""

    def __init__(self, path: str | Path):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(f), "pt") for f in files]
        self.where = {name: h for h in self._handles for name in h.keys()}

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or its [start, stop) range along `dim`."""
        view = self.where[name].get_slice(name)
        if dim is None:
            return view[:]
        index = (slice(None),) * dim + (slice(start, stop),)
        return view[index]


def _chunk(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of chunk `rank` of `size` along a dimension of n, as torch.chunk cuts it."""
    step = -(-n // size)
    return min(rank * step, n), min((rank + 1) * step, n)


def _read_local(ckpt: _Checkpoint, layout: str, names: list[str], hf, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a rule's merged tensor, reading only that shard's slices of the HF tensors:
    equal to shard(layout, merge(layout, full tensors), rank, size)."""
    if layout == "replicated" or size == 1:
        return merge(layout, [ckpt.read(n) for n in names], hf)
    if layout in ("rows", "columns"):
        (name,) = names
        dim = 0 if layout == "rows" else 1
        return ckpt.read(name, dim, *_chunk(ckpt.shape(name)[dim], rank, size))
    if layout == "gate_up":
        return torch.cat([ckpt.read(n, 0, *_chunk(ckpt.shape(n)[0], rank, size)) for n in names])
    groups, q_per_group, d = _qkv_shape(hf)  # qkv: whole query groups per rank
    first, last = _chunk(groups, rank, size)
    rows = [(first * q_per_group * d, last * q_per_group * d), (first * d, last * d), (first * d, last * d)]
    q, k, v = (ckpt.read(n, 0, a, b) for n, (a, b) in zip(names, rows))
    return _interleave(q, k, v, last - first, d)


#: an HF tensor of a decoder layer: its layer index
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: the suffix of the block scales of an FP8 checkpoint's weights (DeepSeek-V3's published one: one fp32 scale per
#: 128x128 block, w = fp8 · scale_inv)
FP8_SCALE_SUFFIX = "weight_scale_inv"


def _refused_tensors(names: list[str], hf) -> str | None:
    """Why a checkpoint with tensors `names` cannot load, whatever the parallel layout (every rank asks the same
    question, so every rank refuses), or None."""
    scaled = sorted(n for n in names if n.endswith(FP8_SCALE_SUFFIX))
    if scaled:
        return (f"an FP8 checkpoint ({len(scaled)} block scales {FP8_SCALE_SUFFIX}, e.g. {scaled[0]}): qurl-mcore "
                "trains and serves BF16 checkpoints; convert it to BF16 first (w = fp8 · scale_inv on each "
                "128x128 block, as DeepSeek-V3's inference/fp8_cast_bf16.py does) and give that directory")
    beyond = sorted(n for n in names if (m := _HF_LAYER.search(n)) and int(m[1]) >= hf.num_hidden_layers)
    if beyond:
        return (f"{len(beyond)} tensors of layers beyond num_hidden_layers={hf.num_hidden_layers} (e.g. "
                f"{beyond[0]}): a multi-token-prediction (MTP) module, which qurl-mcore neither trains nor "
                "serves; write the checkpoint without those layers")
    return None


def load_hf_weights(model, hf_dir: str | Path) -> None:
    """Copy the HF checkpoint in directory `hf_dir` into this rank's shards of `model`, cast to the
    parameters' dtype, reading only the tensors and slices this rank owns. Raises if a parameter has no
    source or an HF tensor is unused (a tied checkpoint may carry a redundant output layer: the HF tensors of
    the table's untied-only slots); on every rank, whatever the layout, for an FP8 checkpoint and for tensors
    of layers the config does not have (MTP)."""
    hf = load_hf_config(hf_dir)
    ckpt = _Checkpoint(hf_dir)
    refused = _refused_tensors(list(ckpt.where), hf)
    if refused:
        raise ValueError(f"{hf_dir}: {refused}")
    where = _placement(model)
    rules = [(r, pattern(r.megatron)) for r in slots(hf)]
    used: set[str] = set()
    for name, param in _weights(model, rules):
        rule, names = _sources(rules, name, where)
        group = where.etp_group if rule.per_expert else where.tp_group
        missing = [n for n in names if n not in ckpt.where]
        if missing:
            raise KeyError(f"{name} needs {missing}, absent from the HF checkpoint")
        local = _read_local(ckpt, rule.layout, names, hf, group.rank(), group.size())
        if local.shape != param.shape:
            raise ValueError(f"{name}: HF gives {tuple(local.shape)}, the model has {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(local.to(param.dtype))
        used.update(names)
    redundant = {t for s in architecture(hf).slots if s.needs == "untied" for t in s.hf} if hf.tie_word_embeddings \
        else set()
    unused = set(ckpt.where) - used - redundant
    if where.ep_group.size() == where.pp_group.size() == 1 and unused:  # else other ranks use the rest
        raise KeyError(f"HF tensors not loaded: {sorted(unused)[:8]}")


def _weights(model, rules: list[tuple[Slot, re.Pattern]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, and the buffers the table has a slot for (DeepSeek-V3's router expert bias)."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if any(p.match(n) for _, p in rules))


# ---- Megatron -> HF --------------------------------------------------------------------------------

def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    if group.size() == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _iter_stage_tensors(model, hf, where: _Placement) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every rule instance of this pipeline stage (its layers; the embedding on
    the first stage, the final norm and output layer on the last); collective over the stage's TP/EP ranks."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for rule in slots(hf):
        if not rule.exported:
            continue
        layers = range(where.local_layers) if rule.per_layer else [None]
        experts = range(where.local_experts) if rule.per_expert else [None]
        for local_layer in layers:
            layer = None if local_layer is None else where.layer_offset + local_layer
            for local in experts:
                name = _fill(rule.megatron, local_layer, local)
                if name not in params:  # a stage without the embedding or the output layer
                    continue
                param = params[name].detach()
                if local is None:
                    full = unshard(rule.layout, _all_gather(param, where.tp_group))
                    yield from zip((_fill(t, layer, None) for t in rule.hf), split(rule.layout, full, hf))
                    continue
                full = unshard(rule.layout, _all_gather(param, where.etp_group))
                for ep_rank, owned in enumerate(_all_gather(full, where.ep_group)):
                    expert = ep_rank * where.local_experts + local
                    yield from zip((_fill(t, layer, expert) for t in rule.hf), split(rule.layout, owned, hf))


def _iter_hf_tensors(model, hf) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for the whole model on every rank; collective: every rank must iterate in
    step. With pipeline stages, each stage's tensors go to the others one at a time (a header, then the
    tensor, broadcast over the pipeline group), so no rank holds more than one at once."""
    where = _placement(model)
    pp = where.pp_group
    if pp.size() == 1:
        yield from _iter_stage_tensors(model, hf, where)
        return
    device = next(model.parameters()).device
    for stage in range(pp.size()):
        src = dist.get_global_rank(pp, stage)
        mine = _iter_stage_tensors(model, hf, where) if pp.rank() == stage else None
        while True:
            item = next(mine, None) if mine is not None else None
            header = [None if item is None else (item[0], list(item[1].shape), dtype_name(item[1].dtype))]
            dist.broadcast_object_list(header, src=src, group=pp, device=device)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(shape, dtype=getattr(torch, dtype),
                                                                               device=device)
            dist.broadcast(tensor, src=src, group=pp)
            yield name, tensor


def export_hf_weights(
    model,
    hf_config,
    *,
    bucket_bytes: int = 512 * 2**20,
    dtype: torch.dtype | None = None,
    uaq_scale: float | None = None,
    uaq_scope: str = "all",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Megatron weights as HF-named full tensors, in buckets of at most `bucket_bytes` (a single larger
    tensor travels alone). Every rank of the model must iterate it (it gathers shards); every rank gets
    the same buckets. `dtype` casts (e.g. torch.bfloat16 for SGLang); `uaq_scale` applies UAQ with that s
    over `uaq_scope` to the exported tensors (for a model not UAQ-scaled in place)."""
    hf = load_hf_config(hf_config)
    cast = export_cast(hf, dtype)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _iter_hf_tensors(model, hf):
            if uaq_scale is not None:
                tensor = uaq_scale_hf(name, tensor, uaq_scale, hf, uaq_scope)
            yield name, cast(name, tensor)

    yield from buckets(tensors(), bucket_bytes)


def export_cast(hf_config, dtype: torch.dtype | None) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """(HF name, tensor) -> the tensor in `dtype` (None: its own), except the table's fp32 tensors (`Slot.fp32`,
    the router's expert bias), which stay fp32: Megatron and SGLang both route with an fp32 bias."""
    fp32 = [pattern(t) for s in slots(hf_config) if s.fp32 for t in s.hf]

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if any(p.match(name) for p in fp32):
            return tensor.float()
        return tensor if dtype is None else tensor.to(dtype)

    return cast
