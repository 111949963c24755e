"""Activation smoothing for the quantized rollout (SmoothQuant), framework-free: the calibration of per-channel
scales, and their fold into the HF-named weights an engine loads.

A linear Y = X·Wᵀ computes the same with its input channels rescaled, X·Wᵀ = (X·diag(1/s))·(W·diag(s))ᵀ. With
s_j = max|X_j|^α / max|W_j|^(1−α) (α the migration strength, `rollout.smoothing`; maxima over the calibration
tokens and over the rows of every linear that reads X) an outlier channel of X is divided down and its weight
column multiplied up, so per-token activation quantization loses less. The 1/s is folded into whatever produces X,
so the engine runs no extra operation (`ABSORB`, by the UAQ role of each tensor in `qurl_mcore.models`):

  point linear_qkv   q, k, v columns · s      input_layernorm γ / s      (RMSNorm(x)·γ is linear in γ)
  point linear_proj  o columns · s            v rows (and v bias) / s    (attention output is linear in V)
  point linear_fc1   gate, up columns · s     post-attention norm γ / s
  point linear_fc2   down columns · s         up rows / s                (silu(gate)·up is linear in up)

Grouped-query attention: o's input channel (q head h, dim d) is the output of v row (kv head h // (H/G), d),
which the H/G q heads of a group share; so a linear_proj scale is one per v row, [G, head_dim], and o's columns of
the group's heads all take it (the maxima are taken over the group too). q/k norms and RoPE act on q/k outputs,
which smoothing leaves unchanged; q/k biases too.

Multi-head latent attention (DeepSeek-V3) is left unsmoothed: o_proj's input is kv_b_proj's v rows, which no role
here names apart from its k rows, and q_b_proj / kv_b_proj read latents whose norms no point covers; its first
layers' dense MLPs are smoothed.

Left unsmoothed, by `SMOOTHED`: routed experts (their gate/up read the normalised x that the router reads: a
norm fold would change the router's input, and compensating in the router's columns would change its bf16
rounding and so flip near-tied top-k choices; their down inputs are per expert, seen by the tokens routed there
only) and a shared expert's gate/up (they read the same x as the router). A shared expert's down is smoothed.

α = 0 is off (no scales, the engines get the trainer's weights as they are), not the formula's α → 0 limit.

UAQ (`qurl_mcore.uaq`, W·X = (W/u)·(u·X)) composes: the trainer holds the UAQ-scaled parameters, the export
carries them, and the fold is applied to the export, so the engine quantizes (W/u)·diag(s) and its norm is
γ·u/s. The scales are calibrated on the unscaled model, so UAQ's u survives in the engine's weight.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from qurl_mcore.models.registry import config_dict, shape, slots

#: the smallest maximum a scale is computed from (SmoothQuant's clamp): a channel never seen nonzero
EPS = 1e-5
#: (linear group, point) pairs that are smoothed (module docstring: why the others are not)
SMOOTHED = frozenset({("attention", "linear_qkv"), ("attention", "linear_proj"), ("mlp", "linear_fc1"),
                      ("mlp", "linear_fc2"), ("shared_experts", "linear_fc2")})
#: UAQ role -> (point, the point's linear group where the tensor is not in it (a norm), axis, exponent): the
#: tensor is multiplied by the point's scale**exponent along `axis` (1: the input columns of a consumer of the
#: point's input; 0: the output rows of its producer, or a norm's entries)
ABSORB: dict[str, tuple[tuple[str, str | None, int, int], ...]] = {
    "attn_norm": (("linear_qkv", "attention", 0, -1),),
    "q": (("linear_qkv", None, 1, 1),), "k": (("linear_qkv", None, 1, 1),),
    "v": (("linear_qkv", None, 1, 1), ("linear_proj", None, 0, -1)),
    "v_bias": (("linear_proj", None, 0, -1),),
    "o": (("linear_proj", None, 1, 1),),
    "mlp_norm": (("linear_fc1", "mlp", 0, -1),),
    "gate": (("linear_fc1", None, 1, 1),),
    "up": (("linear_fc1", None, 1, 1), ("linear_fc2", None, 0, -1)),
    "down": (("linear_fc2", None, 1, 1),),
}
#: the point whose scale is one per key-value head's row (module docstring, grouped-query attention)
GROUPED = "linear_proj"


@dataclass(frozen=True)
class Absorb:
    """A tensor's share of one scale: multiplied by scales[key]**exponent along `axis`."""

    key: str
    axis: int
    exponent: int


def point_key(layer: int, group: str, point: str) -> str:
    return f"layers.{layer}.{group}.{point}"


def _entries(hf_config: object, groups: Iterable[str]) -> list[tuple[str, Absorb]]:
    """(HF tensor name, what it absorbs) for every smoothed point of the model among `groups`, in the layers each
    tensor exists in. A point is smoothed only where it has both sides, a consumer whose columns take s and a
    tensor that takes 1/s: a norm before a layer without a dense MLP has no consumer; MLA's o_proj (DeepSeek-V3)
    has no producer among these roles (its input is kv_b_proj's v rows, interleaved per head with k's)."""
    c = config_dict(hf_config)
    dims, groups = shape(c), frozenset(groups)
    entries = []
    for slot in slots(c):
        if slot.per_expert or not slot.per_layer:
            continue
        for template, role in zip(slot.hf, slot.uaq):
            for point, group, axis, exponent in ABSORB.get(role, ()):
                group = group or slot.group
                if (group, point) in SMOOTHED and group in groups:
                    entries += [(template.format(layer=layer), Absorb(point_key(layer, group, point), axis, exponent))
                                for layer in dims.slot_layers(slot)]
    read = {a.key for _, a in entries if a.axis == 1}
    absorbed = {a.key for _, a in entries if a.axis == 0}
    return [(name, a) for name, a in entries if a.key in read and a.key in absorbed]


def fold_table(hf_config: object, groups: Iterable[str]) -> dict[str, tuple[Absorb, ...]]:
    """HF tensor name -> the scales it absorbs, for the smoothed points of the linear `groups` (the groups the
    rollout quantizes); tensors absent are left as they are."""
    table: dict[str, tuple[Absorb, ...]] = {}
    for name, absorb in _entries(hf_config, groups):
        table[name] = table.get(name, ()) + (absorb,)
    return table


def smoothing_points(hf_config: object, groups: Iterable[str]) -> dict[str, list[str]]:
    """Point key -> the HF weights that read the point's input (the consumers, whose columns take s)."""
    points: dict[str, list[str]] = {}
    for name, absorb in _entries(hf_config, groups):
        if absorb.axis == 1 and name.endswith(".weight"):
            points.setdefault(absorb.key, []).append(name)
    return points


def scales_from_maxima(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|X|^α / max|W|^(1−α), per channel, each maximum clamped at `EPS`; fp32."""
    if not 0 < alpha <= 1:
        raise ValueError(f"smoothing strength α must be in (0, 1] (0 is off), got {alpha}")
    return x_max.float().clamp(min=EPS) ** alpha / w_max.float().clamp(min=EPS) ** (1 - alpha)


def _per_kv_row(t: torch.Tensor, hf: Mapping) -> torch.Tensor:
    """A [H·d] channel maximum of o's input as [G, d]: the maximum over each group's H/G q heads."""
    s = shape(hf)
    return t.view(s.kv_heads, s.heads // s.kv_heads, s.head_dim).amax(dim=1)


@torch.no_grad()
def calibrate(model: torch.nn.Module, prompts: Iterable[torch.Tensor], hf_config: object, groups: Iterable[str],
              alpha: float, run: Callable[[list[torch.Tensor]], object] | None = None) -> dict[str, torch.Tensor]:
    """The frozen scales of an HF transformers `model` (full precision): its smoothed points' input maxima
    over every token of `prompts` (1-D token id tensors), its consumers' column maxima, and
    `scales_from_maxima`. `run` takes the prompts through the model (None: one `model(ids)` each; a
    `qurl_mcore.layerwise.LayerwiseModel`'s `run`, whose `module` is `model`, holds one layer's weights at a
    time): both maxima are read as each point's first consumer runs, when its layer's weights exist. Point key ->
    fp32 scale ([in] or, for linear_proj, [kv heads, head_dim]), on the CPU. Deterministic for the same model
    and prompts (a maximum depends neither on the order of the tokens nor on that of the prompts)."""
    c = config_dict(hf_config)
    points = smoothing_points(c, groups)
    modules = dict(model.named_modules())
    x_max: dict[str, torch.Tensor] = {}
    w_max: dict[str, torch.Tensor] = {}

    def record(key, consumers):
        def hook(_module, args):
            seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
            x_max[key] = seen if key not in x_max else torch.maximum(x_max[key], seen)
            if key not in w_max:
                weights = [modules[n.removesuffix(".weight")].weight.detach().float() for n in consumers]
                w_max[key] = torch.cat(weights).abs().amax(dim=0)
        return hook

    hooks = [modules[consumers[0].removesuffix(".weight")].register_forward_pre_hook(record(key, consumers))
             for key, consumers in points.items()]
    prompts = list(prompts)
    try:
        if run is not None:
            run(prompts)
        else:
            device = next(model.parameters()).device
            for ids in prompts:
                model(ids.reshape(1, -1).to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    scales = {}
    for key, consumers in points.items():
        if key not in x_max:
            raise ValueError(f"calibration saw no input of {consumers[0]}: give it at least one prompt")
        x, w = x_max[key], w_max[key]
        if key.endswith(GROUPED):
            x, w = _per_kv_row(x, c), _per_kv_row(w, c)
        scales[key] = scales_from_maxima(x, w, alpha).cpu()
    return scales


def _factor(scale: torch.Tensor, n: int) -> torch.Tensor:
    """`scale` as n per-channel factors: as it is, or each kv row's repeated for the q heads of its group."""
    flat = scale.reshape(-1)
    if flat.numel() == n:
        return flat
    if scale.dim() != 2 or n % flat.numel():
        raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit {n} channels")
    return scale[:, None, :].expand(-1, n // flat.numel(), -1).reshape(-1)


def smooth_tensor(name: str, tensor: torch.Tensor, scales: Mapping[str, torch.Tensor],
                  table: Mapping[str, tuple[Absorb, ...]]) -> torch.Tensor:
    """`tensor` (HF parameter `name`) with its share of the scales (`fold_table`) folded in, in fp32; a tensor
    the table does not name comes back as it is."""
    absorbs = table.get(name, ())
    if not absorbs:
        return tensor
    out = tensor.float()
    for a in absorbs:
        view = [1] * out.dim()
        view[a.axis] = -1
        out = out * (_factor(scales[a.key].to(out.device), out.shape[a.axis]) ** a.exponent).view(view)
    return out


def smooth_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]], scales: Mapping[str, torch.Tensor],
                   table: Mapping[str, tuple[Absorb, ...]],
                   cast: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """An HF-named weight stream (buckets of (name, tensor)) with the fold applied, each tensor then given to
    `cast` (the export's cast to the rollout's dtype, `qurl_mcore.megatron.convert.export_cast`; None: each
    keeps its own dtype)."""
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            folded = smooth_tensor(name, tensor, scales, table)
            out.append((name, folded.to(tensor.dtype) if cast is None else cast(name, folded)))
        yield out


#: rollout formats smoothing applies to (`refusal` says why not the others)
SMOOTHED_FORMATS = ("int8", "fp8_e4m3")


def refusal(fmt: str | None) -> str | None:
    """Why smoothing cannot serve a rollout in format `fmt` (None: full-precision engines), None where it does."""
    if fmt in SMOOTHED_FORMATS:
        return None
    if fmt is None:
        return "the engines run full precision, so there is no activation quantization for it to help"
    return (f"{fmt} quantizes activations in small blocks along the input channels, each block with its own "
            "scale, so an outlier channel already costs only its own block; smoothing's effect on it is not "
            "measured")
