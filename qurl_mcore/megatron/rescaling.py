"""UAQ (QuRL §4.3) on a Megatron GPTModel, in place and shard-local, and the update-capture measurement.

The rescaling and its exactness argument are in `qurl_mcore.uaq`; this module applies `UAQ_EXPONENTS` to
Megatron's layouts: in linear_qkv the rows of each local query group are [q heads, k, v], in linear_fc1
(SwiGLU) the local rows are [gate; up], in MLA's linear_kv_up_proj each local head's rows are [k_nope; v]. Every
factor multiplies whole rows or whole tensors, so each TP/EP rank scales its own shards with no communication.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from qurl_mcore.models.registry import megatron_slot
from qurl_mcore.models.slots import Slot
from qurl_mcore.uaq import PER_HEAD_ROLES, rescales, scale_per_head, uaq_exponent, update_capture_ratio

from .spec import linear_group


def _scale(t: torch.Tensor, slot: Slot, config, s: float, scope: str) -> None:
    """Multiply this rank's shard `t` of `slot`'s parameter by s**k of each HF tensor's role over UAQ scope `scope`
    (`qurl_mcore.uaq.uaq_exponent`), in the slot's layout: whole rows of each local query group [q heads, k, v]
    (qkv), the halves [gate; up] (gate_up), each head's parts (MLA's [k_nope; v]), or the whole tensor."""
    if slot.uaq[0] in PER_HEAD_ROLES:
        t.copy_(scale_per_head(t, slot.uaq[0], (config.qk_head_dim, config.v_head_dim), s, scope))
        return
    factors = [s ** uaq_exponent(role, scope) for role in slot.uaq]
    if slot.layout == "qkv":
        q_per_group = config.num_attention_heads // config.num_query_groups
        groups = t.view(-1, q_per_group + 2, config.kv_channels, *t.shape[1:])
        for part, f in zip((groups[:, :q_per_group], groups[:, q_per_group], groups[:, q_per_group + 1]), factors):
            part.mul_(f)
    elif slot.layout == "gate_up":
        for half, f in zip(t.chunk(2, dim=0), factors):
            half.mul_(f)
    else:
        (f,) = factors
        t.mul_(f)


def apply_uaq(model: torch.nn.Module, s: float = 1.5, scope: str = "all") -> list[str]:
    """Rescale `model` in place so that it computes the same function with the weight of every quantized linear
    of UAQ scope `scope` divided by s where exact (see `qurl_mcore.uaq`; "experts": the MLP block only); returns
    the names of the parameters changed. Needs SwiGLU MLPs and no bias on linear_proj/fc1/fc2 (every
    architecture of `qurl_mcore.models`)."""
    config = model.config
    if not config.gated_linear_unit or config.add_bias_linear:
        raise NotImplementedError("UAQ here needs a gated MLP (SwiGLU) and add_bias_linear=False")
    if s <= 0:
        raise ValueError(f"the UAQ factor must be positive, got {s}")
    changed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            slot = megatron_slot(name)
            if slot is not None and rescales(slot.uaq, scope):
                _scale(param.data, slot, config, s, scope)
                changed.append(name)
    return changed


def quantized_weights(model: torch.nn.Module,
                      select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Detached copies of this rank's shards of the weights some scope quantizes (every linear of
    `qurl_mcore.models.slots.LINEAR_GROUPS`), or of those whose names `select` accepts."""
    select = select or (lambda name: linear_group(name) is not None)
    return {n: p.detach().clone() for n, p in model.named_parameters() if select(n)}


def update_capture(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    *,
    scales: Iterable[float] = (1.0, 1.5, 2.0),
    fmts: Iterable[str] = ("int8", "fp8_e4m3"),
    granularity: str = "channel",
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    uaq_scope: str = "all",
    select: Callable[[str], bool] | None = None,
) -> dict[float, dict[str, float]]:
    """{s: {fmt: update capture ratio}}: for each s, start from `model`'s current weights, apply UAQ(s) over
    `uaq_scope` (s = 1 is no UAQ), take one optimizer step on `loss_fn(model)` (default Adam, lr 1e-5), and
    measure the share of the entries of the weights `select` names (default: every quantized linear's,
    `quantized_weights`) whose quantized value changed. `model` is restored afterwards."""
    make_optimizer = make_optimizer or (lambda params: torch.optim.Adam(params, lr=1e-5))
    original = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    fmts = tuple(fmts)
    result: dict[float, dict[str, float]] = {}
    try:
        for s in scales:
            model.load_state_dict(original, strict=False)
            apply_uaq(model, s, uaq_scope)
            before = quantized_weights(model, select)
            optimizer = make_optimizer(model.parameters())
            optimizer.zero_grad()
            loss_fn(model).backward()
            optimizer.step()
            after = quantized_weights(model, select)
            result[s] = {fmt: update_capture_ratio(before, after, fmt, granularity) for fmt in fmts}
    finally:
        model.load_state_dict(original, strict=False)
        model.zero_grad(set_to_none=True)
    return result
