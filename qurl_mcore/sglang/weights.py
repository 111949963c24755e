"""Full-precision master weights and their quantized copies across SGLang's weight-update session.

Lifecycle of one weight `W` of a quantized layer (SGLang 0.5.23):
  create_weights                 W is a full-precision Parameter that the checkpoint loaders write into
  process_weights_after_loading  Q(W) = quantize_weight(W, spec) serves the forward; W leaves the module and
                                 waits as the master copy (on the host by default)
  begin_weight_update            restore_weights_before_loading puts the very same Parameter back (with its
                                 loader attributes), so a partial or bucketed update overwrites only the
                                 rows it carries and every other row keeps its exact full-precision value
  update_weights_from_*          SGLang's loaders write the pushed BF16 tensors into W
  end_weight_update              process_weights_after_loading re-quantizes; the quantized tensors are
                                 overwritten in place, so captured CUDA graphs keep reading valid memory
"""
from __future__ import annotations

import torch

from qurl_mcore.quant import QTensor

_MASTERS = "_qurl_masters"


def detach_master(layer: torch.nn.Module, name: str, host: bool) -> None:
    """Take Parameter `name` off the layer and keep it as the master (its data moved to the CPU if `host`)."""
    param = layer._parameters.pop(name)
    device = param.device
    if host:
        param.data = param.data.to("cpu")
    layer.__dict__.setdefault(_MASTERS, {})[name] = (param, device)


def attach_master(layer: torch.nn.Module, name: str) -> None:
    """Put the master Parameter `name` back on the layer, on the device it came from (no-op if present)."""
    masters = layer.__dict__.get(_MASTERS, {})
    if name not in masters:
        return
    param, device = masters.pop(name)
    param.data = param.data.to(device)
    layer.register_parameter(name, param)


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


def stack(experts: list[QTensor]) -> tuple[torch.Tensor, torch.Tensor, list[QTensor]]:
    """Stacked [E, ...] codes and scales for a fused MoE kernel, and the same per-expert QTensors re-pointed at
    views of them (one copy of the weights; refreshing the views in place refreshes the stacks)."""
    data = torch.stack([q.data for q in experts])
    scale = torch.stack([q.scale for q in experts])
    views = [QTensor(data[e], scale[e], q.fmt, q.granularity, q.shape, q.dtype, q.block_shape, q.global_scale)
             for e, q in enumerate(experts)]
    return data, scale, views
