"""Full-precision master weights and their quantized copies across SGLang's weight-update session.

Lifecycle of one weight `W` of a quantized linear (SGLang 0.5.23):
  create_weights                 W is a full-precision Parameter that the checkpoint loaders write into
  process_weights_after_loading  Q(W) = quantize_weight(W, spec) serves the forward on W's device (its home);
                                 W leaves the module and waits as the master copy: in pinned host memory by
                                 default (master="host"), else where it was (master="device")
  begin_weight_update            restore_weights_before_loading puts the very same Parameter back (with its
                                 loader attributes) where it waits, so a partial or bucketed update
                                 overwrites only the rows it carries and every other row keeps its exact
                                 full-precision value; a host master stays on the host and the loaders copy
                                 the pushed rows into it across the bus
  update_weights_from_*          SGLang's loaders write the pushed BF16 tensors into W
  end_weight_update              process_weights_after_loading re-quantizes, one weight at a time from a copy
                                 at home (`at_home`), so the device never holds more than one matrix of
                                 masters; the quantized tensors are overwritten in place, so captured CUDA
                                 graphs keep reading valid memory

A FusedMoE's experts (moe.py) differ in one thing: they are quantized as they load, never after. Their codes
and scales are allocated with the layer (`empty_stack`), their master is created where it waits (pinned host
memory by default: the checkpoint's experts are written there, never staged whole on the device), and the
weight loader quantizes each expert's rows from a copy at home as soon as a checkpoint or pushed piece gives
them (`store_rows`), the checkpoint's load and every push alike.

SGLang runs a layer's restore and re-quantization inside `device_loading_context(layer, device)`
(model_loader/loader.py), which stages every tensor registered on the layer on the engine's device for the
call and afterwards sends a tensor newly registered during it (a re-attached master) to the device too: every
host master would reach the GPU at the start of a push and stay there until its end, and the re-quantization
would copy each layer's masters up whole. A layer that holds qurl masters therefore skips that staging
(`masters_stay_put`, a hook the plugin registers): its restore only re-attaches masters where they wait, and
its re-quantization copies one matrix at a time home itself (`at_home`).

A code push (the `push: codes` option) keeps no master. The checkpoint loads and is quantized as above, then its
full-precision weight is dropped (`release`; an expert's rows live only in a buffer of one expert while they
are quantized). A weight-update session registers the installed codes and scales
themselves as Parameters over the same storage (`attach_codes`: `weight`, `weight_scale`, `weight_global_scale`,
the names `qurl_mcore.quant.wire` sends), so SGLang's loaders write the pushed codes in place, sharded as they
shard the full-precision weight; the session's end only takes them off again (`detach_codes`): nothing is
re-quantized. `installed_digests` reports what every quantized layer holds (`quant.wire.digest`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from qurl_mcore.quant import QTensor
from qurl_mcore.quant.wire import GLOBAL_SCALE, SCALE, unit_digest

_MASTERS = "_qurl_masters"
_HOMES = "_qurl_homes"
_CODES = "_qurl_codes"
#: SGLang's staging of a layer's tensors on the engine's device around its restore/re-quantization
LOADING_CONTEXT = "sglang.srt.model_loader.loader.device_loading_context"


#: SGLang's read-back of a parameter by name, which answers `DIGESTS` with `installed_digests`
WEIGHTS_BY_NAME = "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter.get_weights_by_name"
#: the name that asks an engine (`get_weights_by_name`) for the digests of its installed codes
DIGESTS = "qurl.installed_digests"

_registered = False


def register() -> None:
    """Hook `masters_stay_put` around SGLang's `device_loading_context` and `report_digests` around its
    `get_weights_by_name` (applied by SGLang's `load_plugins` after the plugins ran; imports SGLang). Idempotent."""
    global _registered
    if _registered:
        return
    # SGLang only where the plugin is loaded: the rest of this module serves the quant methods alone
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LOADING_CONTEXT, masters_stay_put, HookType.AROUND)
    HookRegistry.register(WEIGHTS_BY_NAME, report_digests, HookType.AROUND)
    _registered = True


def report_digests(original: Callable, exporter, name: str, truncate_size: int = 100):
    """SGLang's `get_weights_by_name`, except that the name `DIGESTS` answers `installed_digests` of the model,
    gathered over the engine's TP ranks (every rank runs the request; the first rank's answer is returned):
    `quant.wire.unit_digest` of each unit's shards in rank order, as the trainer computes it."""
    if name != DIGESTS:
        return original(exporter, name, truncate_size)
    from sglang.srt.distributed import get_tp_group

    local = installed_digests(exporter.get_model())
    group = get_tp_group()
    if group.world_size == 1:
        return local
    ranks: list[dict[str, str]] = [{}] * group.world_size
    torch.distributed.all_gather_object(ranks, local, group=group.cpu_group)  # digests cross ranks, not codes
    out: dict[str, list[str]] = {}
    for answer in ranks:
        for n, d in answer.items():
            out.setdefault(n, []).append(d)
    return {n: unit_digest(ds) for n, ds in out.items()}


def installed_digests(model: torch.nn.Module) -> dict[str, str]:
    """HF name of each unit's first weight -> `quant.wire.digest` of the codes and scales this engine rank serves
    its shard with, for every quantized layer (a FusedMoE: per expert of this rank, w13 under its gate weight, w2
    under its down one)."""
    # the engine's module names and the architecture tables only where an engine answers
    from qurl_mcore.models.registry import sglang_linears
    from qurl_mcore.quant.wire import digest

    from .architecture import checkpoint_prefix

    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        prefix = checkpoint_prefix(prefix)
        if hasattr(module, "qurl_weight"):
            out[sglang_linears(prefix)[1][0] + ".weight"] = digest(module.qurl_weight)
        elif hasattr(module, "qurl_w13_weight_experts"):
            names = sglang_linears(prefix, module.num_experts)[1]
            per = len(names) // module.num_experts  # an expert's gate, up, down
            ids = global_experts(module)
            for e, (w13, w2) in enumerate(zip(module.qurl_w13_weight_experts, module.qurl_w2_weight_experts)):
                g = ids[e]
                out[names[g * per] + ".weight"] = digest(w13)
                out[names[g * per + per - 1] + ".weight"] = digest(w2)
    return out


def global_experts(layer: torch.nn.Module) -> dict[int, int]:
    """Local expert id -> global id of a FusedMoE's experts on this rank (SGLang maps global ids to local ones
    only; -1: another rank's)."""
    local = {g: layer._map_global_expert_id_to_local_expert_id(g) for g in range(layer.num_experts)}
    return {e: g for g, e in local.items() if e != -1}


def masters_stay_put(original: Callable, module: torch.nn.Module, target_device: torch.device):
    """SGLang's `device_loading_context(module, target_device)`, except for a layer holding qurl masters,
    whose tensors stay where they are (module docstring)."""
    if _HOMES in module.__dict__:
        return contextlib.nullcontext(module)
    return original(module, target_device)


def set_home(layer: torch.nn.Module, name: str, device: torch.device) -> None:
    """Remember `device` as the home of `name` (`home`) before its full-precision rows exist anywhere: a layer
    whose weights load straight into host masters (moe.py)."""
    layer.__dict__.setdefault(_HOMES, {})[name] = device


def detach_master(layer: torch.nn.Module, name: str, host: bool) -> None:
    """Take Parameter `name` off the layer and keep it as the master: moved to pinned host memory if `host`
    (pinned: the copies to and from the device run at the bus's speed), else left where it is. Its home, the
    device its quantized copy serves from, is remembered."""
    param = layer._parameters.pop(name)
    layer.__dict__.setdefault(_HOMES, {}).setdefault(name, param.device)
    if host and param.device.type != "cpu":
        pinned = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
        param.data = pinned.copy_(param.data)
    layer.__dict__.setdefault(_MASTERS, {})[name] = param


def attach_master(layer: torch.nn.Module, name: str) -> None:
    """Put the master Parameter `name` back on the layer, where it waits (no-op if present)."""
    param = layer.__dict__.get(_MASTERS, {}).pop(name, None)
    if param is not None:
        layer.register_parameter(name, param)


def release(layer: torch.nn.Module, name: str) -> None:
    """Take Parameter `name` off the layer and keep nothing of it (a code push needs no master)."""
    del layer._parameters[name]


def attach_codes(layer: torch.nn.Module, name: str, q: QTensor, loader: Callable,
                 global_loader: Callable | None = None) -> None:
    """Register `q`'s codes as Parameter `name` and its scales as `name` + SCALE (and + GLOBAL_SCALE), over the
    very storage that serves the forward, with `loader` as their weight loader (rows along dim 0, columns, of
    the codes and of the scales, along dim 1: a row-parallel loader picks its column shard's, `quant.wire`) and
    `global_loader` for the global scale."""
    params = {name: (q.data, {"output_dim": 0, "input_dim": 1, "weight_loader": loader}),
              name + SCALE: (q.scale, {"output_dim": 0, "input_dim": 1, "weight_loader": loader})}
    if q.global_scale is not None:
        params[name + GLOBAL_SCALE] = (q.global_scale, {"weight_loader": global_loader or loader})
    for pname, (tensor, attrs) in params.items():
        param = torch.nn.Parameter(tensor, requires_grad=False)  # shares the storage
        for key, value in attrs.items():
            setattr(param, key, value)
        layer.register_parameter(pname, param)
    layer.__dict__.setdefault(_CODES, []).extend(params)


def detach_codes(layer: torch.nn.Module) -> bool:
    """Take the Parameters `attach_codes` registered off the layer; whether there were any (a code push ended)."""
    names = layer.__dict__.pop(_CODES, None)
    for pname in names or ():
        del layer._parameters[pname]
    return names is not None


def rank_of(rank: int) -> Callable:
    """A weight loader for a unit's global scales ([shards]: one per engine shard, the same on every member of
    the unit, `quant.wire`): shard `rank`'s."""
    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
        param.data.copy_(loaded.reshape(-1)[rank])

    return load


def home(layer: torch.nn.Module, name: str) -> torch.device:
    """The device the quantized copy of `name` serves from: where the Parameter was when first loaded."""
    remembered = layer.__dict__.get(_HOMES, {}).get(name)
    return remembered if remembered is not None else layer._parameters[name].device


def at_home(layer: torch.nn.Module, name: str, w: torch.Tensor) -> torch.Tensor:
    """`w` (the loaded Parameter `name`, or a slice of it) at `home`: `w` itself when it is there, else a
    temporary copy, freed once quantized."""
    return w.to(home(layer, name), non_blocking=True)


def is_loaded(layer: torch.nn.Module, name: str) -> bool:
    """Whether `name` is on the layer as a writable Parameter, i.e. there is something to (re)quantize."""
    return name in layer._parameters


def _same_layout(a: QTensor, b: QTensor) -> bool:
    pairs = [(a.data, b.data), (a.scale, b.scale)]
    if (a.global_scale is None) != (b.global_scale is None):
        return False
    if a.global_scale is not None:
        pairs.append((a.global_scale, b.global_scale))
    return all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in pairs)


def store(old: QTensor | None, new: QTensor) -> QTensor:
    """`new`, written into `old`'s tensors when their layouts match (same addresses, for CUDA graphs)."""
    if old is None or not _same_layout(old, new):
        return new
    old.data.copy_(new.data)
    old.scale.copy_(new.scale)
    if old.global_scale is not None:
        old.global_scale.copy_(new.global_scale)
    return old


def store_rows(old: QTensor, new: QTensor, rows: slice) -> None:
    """`new` written in place into rows `rows` of `old` (codes and scales: groups of one row, so a row of codes
    is a row of scales; `slice(None)`: all of them) and its global scale into `old`'s."""
    old.data[rows].copy_(new.data)
    old.scale[rows].copy_(new.scale)
    if old.global_scale is not None:
        old.global_scale.copy_(new.global_scale)


def empty_stack(experts: int, layout: QTensor, device: torch.device) -> tuple[QTensor, list[QTensor]]:
    """One QTensor of shape [E, *expert shape] for `experts` experts laid out as `layout` (one expert's QTensor;
    its values are not read: a quantization on the meta device will do), uninitialized on `device`, and the
    per-expert QTensors as views of it, so that writing a view in place (`store`, `store_rows`) writes the
    stack: one copy of the weights, the stacked codes and scales serving a fused MoE kernel and
    `quant.experts.experts_forward`. Needs groups of one row (`QTensor.row_grouped`): then the experts' groups,
    stacked, are the stack's groups in order."""
    if not layout.row_grouped:
        raise ValueError(f"cannot stack {layout.fmt} experts quantized per {layout.granularity} "
                         f"{layout.block_shape or ''}: stacking needs groups of one row (channel, or 1 x n blocks)")
    data, scale = (torch.empty((experts, *t.shape), dtype=t.dtype, device=device)
                   for t in (layout.data, layout.scale))
    glob = None if layout.global_scale is None else torch.empty(experts, dtype=layout.global_scale.dtype,
                                                                device=device)
    stacked = QTensor(data, scale, layout.fmt, layout.granularity, torch.Size((experts, *layout.shape)),
                      layout.dtype, glob)  # glob [E]: a batch of tensors (quantize's batch_dims)
    views = [QTensor(data[e], scale[e], layout.fmt, layout.granularity, layout.shape, layout.dtype,
                     None if glob is None else glob[e]) for e in range(experts)]
    return stacked, views


def stack(experts: list[QTensor]) -> tuple[QTensor, list[QTensor]]:
    """`empty_stack` over `experts` (QTensors of one layout), holding their values."""
    stacked, views = empty_stack(len(experts), experts[0], experts[0].data.device)
    for view, q in zip(views, experts):
        store_rows(view, q, slice(None))
    return stacked, views
