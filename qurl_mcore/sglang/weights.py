"""Full-precision master weights and their quantized copies across SGLang's weight-update session.

Lifecycle of one weight `W` of a quantized layer (SGLang 0.5.23):
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
  end_weight_update              process_weights_after_loading re-quantizes, one weight (one expert) at a
                                 time from a copy at home (`at_home`), so the device never holds more than
                                 one matrix of masters; the quantized tensors are overwritten in place, so
                                 captured CUDA graphs keep reading valid memory

SGLang runs a layer's restore and re-quantization inside `device_loading_context(layer, device)`
(model_loader/loader.py), which stages every tensor registered on the layer on the engine's device for the
call and afterwards sends a tensor newly registered during it (a re-attached master) to the device too: every
host master would reach the GPU at the start of a push and stay there until its end, and the re-quantization
would copy each layer's masters up whole. A layer that holds qurl masters therefore skips that staging
(`masters_stay_put`, a hook the plugin registers): its restore only re-attaches masters where they wait, and
its re-quantization copies one matrix at a time home itself (`at_home`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from qurl_mcore.quant import QTensor

_MASTERS = "_qurl_masters"
_HOMES = "_qurl_homes"
#: SGLang's staging of a layer's tensors on the engine's device around its restore/re-quantization
LOADING_CONTEXT = "sglang.srt.model_loader.loader.device_loading_context"


_registered = False


def register() -> None:
    """Hook `masters_stay_put` around SGLang's `device_loading_context` (applied by SGLang's `load_plugins`
    after the plugins ran; imports SGLang). Idempotent."""
    global _registered
    if _registered:
        return
    # SGLang only where the plugin is loaded: the rest of this module serves the quant methods alone
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LOADING_CONTEXT, masters_stay_put, HookType.AROUND)
    _registered = True


def masters_stay_put(original: Callable, module: torch.nn.Module, target_device: torch.device):
    """SGLang's `device_loading_context(module, target_device)`, except for a layer holding qurl masters,
    whose tensors stay where they are (module docstring)."""
    if _HOMES in module.__dict__:
        return contextlib.nullcontext(module)
    return original(module, target_device)


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


def stack(experts: list[QTensor]) -> tuple[QTensor, list[QTensor]]:
    """One QTensor of shape [E, *expert shape] over the experts (one copy of the weights: the stacked codes
    and scales serve a fused MoE kernel and `quant.experts.experts_forward`), and the per-expert QTensors
    re-pointed at views of it, so that refreshing a view in place (`store`) refreshes the stack. Needs groups
    of one row (`QTensor.row_grouped`): then the experts' groups, stacked, are the stack's groups in order."""
    first = experts[0]
    if not first.row_grouped:
        raise ValueError(f"cannot stack {first.fmt} experts quantized per {first.granularity} "
                         f"{first.block_shape or ''}: stacking needs groups of one row (channel, or 1 x n blocks)")
    data = torch.stack([q.data for q in experts])
    scale = torch.stack([q.scale for q in experts])
    glob = None if first.global_scale is None else torch.stack([q.global_scale for q in experts])
    stacked = QTensor(data, scale, first.fmt, first.granularity, torch.Size((len(experts), *first.shape)),
                      first.dtype, glob)  # glob [E]: a batch of tensors (quantize's batch_dims)
    views = [QTensor(data[e], scale[e], q.fmt, q.granularity, q.shape, q.dtype, None if glob is None else glob[e])
             for e, q in enumerate(experts)]
    return stacked, views
