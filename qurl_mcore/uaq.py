"""Update-Aware Quantization (QuRL §4.3), framework-free: the rescaling table and the update-capture metric.

UAQ folds a factor s into the parameters in front of a linear map and divides the map's weight by s:
W·X = (W/s)·(s·X). Quantization noise of W/s is s times smaller, while the gradient of W/s, ∇Y·(sX)ᵀ, is s
times larger, so an SGD update is s² larger relative to the quantization step (with Adam, whose step does
not scale with the gradient, it is s). The foldings used, all exact in real arithmetic:

  input_layernorm γ·s  and  q, k, v rows of linear_qkv / s   (RMSNorm(x)·γ is linear in γ)
  v rows (and v bias) · s  and  linear_proj / s               (attention output is linear in V)
  pre_mlp_layernorm γ·s and  gate, up rows of fc1 / s, router / s, shared-expert gate / s (Qwen2-MoE's
                             sigmoid(w·x) reads the same x as the router: role "router")
  up rows · s           and  fc2 / s                          (silu(gate)·up is linear in up)

Net exponent of s per tensor (`UAQ_EXPONENTS`): the v and up rows come back to their original values; the q/k
biases and the gate keep theirs, so RoPE, q/k norms and the SiLU see unchanged inputs. The router's input
grows by s, so it is divided by s: it stays in high precision, the division only keeps routing unchanged.

Multi-head latent attention (DeepSeek-V3, `qurl_mcore.models.deepseek_v3`):

  input_layernorm γ·s   and  q_a_proj / s, kv_a_proj_with_mqa / s   (the latents and the RoPE key unchanged)
  kv_a_layernorm γ·s    and  kv_b_proj's k_nope rows / s            (k unchanged; its v rows stay: v·s)
  v·s                   and  o_proj / s

kv_b_proj holds, head by head, k_nope rows then v rows, so its role is split per head (`PER_HEAD_ROLES`): each
part takes the exponent of the role it plays (k: −1, v: 0). The down projections (role "latent") are full
precision on both sides; their 1/s only undoes the norm's s. q_b_proj keeps W (why: the table's docstring,
`qurl_mcore.models.deepseek_v3`).

A UAQ scope (`UAQ_ROLES`, named as the precision scopes of `qurl_mcore.precision.SCOPES`) limits the rescaling to
the roles around the linears it names; every other tensor keeps its value. Scope "experts" is the MLP block:

  pre_mlp_layernorm γ·s  and  every consumer of its output / s: the experts' gate and up rows, the router, a
                              shared expert's gate and up rows and its sigmoid gate (a dense MLP's fc1 alike)
  up rows · s            and  fc2 / s  (each expert's, each shared expert's)

This is exact for the same reasons; the attention, its norm and MLA's latents are untouched. The router keeps
its logits, (W_r/s)·(s·x) = W_r·x, so it picks the same experts up to the rounding of W_r/s and γ·s (none at all
when s is a power of two). The shared experts are full precision in this scope; they take the same exponents
as the routed ones because they read the same scaled input.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from qurl_mcore.models.registry import hf_uaq_role, shape
from qurl_mcore.quant import quantize
from qurl_mcore.quant.qtensor import no_host_reads

#: role -> k such that UAQ multiplies the tensor by s**k
UAQ_EXPONENTS: dict[str, int] = {
    "attn_norm": 1, "q": -1, "k": -1, "v": 0, "q_bias": 0, "k_bias": 0, "v_bias": 1, "o": -1,
    "mlp_norm": 1, "gate": -1, "up": 0, "down": -1, "router": -1,
    "latent": -1, "kv_latent_norm": 1,
}
#: role -> the roles of the parts each head's rows hold, in order (MLA's kv_b_proj: [k_nope; v] per head)
PER_HEAD_ROLES: dict[str, tuple[str, ...]] = {"kv_b": ("k", "v")}
#: UAQ scope -> the roles it rescales (module docstring); a tensor of any other role keeps its value
UAQ_ROLES: dict[str, frozenset[str]] = {
    "all": frozenset(UAQ_EXPONENTS),
    "experts": frozenset({"mlp_norm", "gate", "up", "down", "router"}),
}


def uaq_exponent(role: str | None, scope: str = "all") -> int:
    """k such that UAQ over `scope` multiplies a tensor (or a per-head part) of `role` by s**k: 0 outside the
    scope's roles and for tensors without a role."""
    if scope not in UAQ_ROLES:
        raise ValueError(f"unknown UAQ scope {scope!r}; use one of {list(UAQ_ROLES)}")
    return UAQ_EXPONENTS[role] if role in UAQ_ROLES[scope] else 0


def rescales(roles: tuple[str | None, ...], scope: str = "all") -> bool:
    """Whether UAQ over `scope` changes a tensor holding `roles` (per-head roles by their parts')."""
    return any(uaq_exponent(part, scope) for role in roles if role for part in PER_HEAD_ROLES.get(role, (role,)))


def scale_per_head(t: torch.Tensor, role: str, part_rows: tuple[int, ...], s: float,
                   scope: str = "all") -> torch.Tensor:
    """`t`, whose rows are heads of `part_rows` rows each part, with every head's part i times s**k of
    PER_HEAD_ROLES[role][i] (`uaq_exponent` over `scope`); computed in fp32, returned in t's dtype. A TP shard of
    whole heads scales alike."""
    parts = PER_HEAD_ROLES[role]
    if len(part_rows) != len(parts) or t.shape[0] % sum(part_rows):
        raise ValueError(f"role {role!r}: {t.shape[0]} rows are not heads of parts {part_rows} ({parts})")
    factor = torch.cat([torch.full((n,), float(s ** uaq_exponent(r, scope)), device=t.device)
                        for n, r in zip(part_rows, parts)])
    per_head = t.float().reshape(-1, sum(part_rows), *t.shape[1:])
    return (per_head * factor.view(1, -1, *[1] * (t.dim() - 1))).reshape(t.shape).to(t.dtype)


def uaq_scale_hf(name: str, tensor: torch.Tensor, s: float, hf_config: object = None,
                 scope: str = "all") -> torch.Tensor:
    """`tensor` (HF parameter `name`) as UAQ over `scope` with factor s makes it: tensor·s**k for its role (the
    `uaq` of its slot in the architecture table, `qurl_mcore.models`; `uaq_exponent`), computed in fp32. A role
    split per head (`PER_HEAD_ROLES`) reads its parts' sizes from `hf_config` (MLA: qk_nope_head_dim, v_head_dim)."""
    role = hf_uaq_role(name)
    if not rescales((role,), scope):
        return tensor
    if role in PER_HEAD_ROLES:
        if hf_config is None:
            raise ValueError(f"{name}: UAQ scales its heads' parts apart (role {role!r}); pass the model's "
                             "config (hf_config) for their sizes")
        mla = shape(hf_config)
        return scale_per_head(tensor, role, (mla.qk_nope_head_dim, mla.v_head_dim), s, scope)
    return (tensor.float() * s ** uaq_exponent(role, scope)).to(tensor.dtype)


def _codes(w: torch.Tensor, fmt: str, granularity: str) -> torch.Tensor:
    codes = quantize(w.detach().float(), fmt, granularity).codes()
    return codes.view(torch.uint8) if codes.dtype.is_floating_point else codes  # compare FP8 codes bitwise


def update_capture_ratio(
    before: torch.Tensor | Mapping[str, torch.Tensor],
    after: torch.Tensor | Mapping[str, torch.Tensor],
    fmt: str,
    granularity: str = "channel",
) -> float:
    """Share of weight entries whose quantization code changed, Σ [code(after) ≠ code(before)] / Σ entries,
    over one tensor or over every tensor of two same-keyed mappings. Codes are those of
    `qurl_mcore.quant.quantize(w, fmt, granularity)` (per-channel by default, QuRL's weight quantization).
    Codes, not dequantized values: the row maximum moves in almost every step, which rescales the whole row
    without the row's other updates being captured."""
    if isinstance(before, torch.Tensor):
        before, after = {"": before}, {"": after}
    if before.keys() != after.keys():
        raise ValueError(f"the two weight sets differ in names: {sorted(set(before) ^ set(after))[:5]}")
    changed, total = None, 0
    for name, b in before.items():
        a = after[name]
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(b.shape)} before, {tuple(a.shape)} after")
        # counted on the device and read once: a read per tensor is a GPU synchronization per tensor
        with no_host_reads():
            n = (_codes(a, fmt, granularity) != _codes(b, fmt, granularity)).sum()
        changed = n if changed is None else changed + n
        total += b.numel()
    if total == 0:
        raise ValueError("no weight entries to compare")
    return int(changed) / total
