"""Precisions: the one table that says how the trainer (Megatron) and the rollout engines (SGLang) compute.

A *precision* names both sides at once, so that they cannot drift apart: the quantized-linear mode of the
trainer's linears, the SGLang method of the engines, the formats it runs in. A *scope* names the linears a
precision quantizes, by *linear group* (the `group` of each weight in its architecture's table,
`qurl_mcore.models`), and both sides ask this module which groups that is:

  scope "experts"  experts + mlp: the routed experts (MoEResQ's experts-only scope); a dense model's MLP is
                   its one expert, so that the scope means the same linears on both sides for every model.
                   Shared experts are not routed experts: they run for every token, like a dense MLP beside
                   the router, and only scope "all" quantizes them
  scope "all"      every linear group (attention, mlp, experts, shared_experts)
Routers, norms, embeddings and the output layer are never quantized.

A precision whose trainer runs full precision while the engines quantize (QuRL's int8/fp8) quantizes
nothing on the trainer by design: the behaviour policy is the quantized one and the loss corrects for it.
Every other asymmetry is an ablation and is a named row of `PRECISIONS` (MoEResQ's one-sided RC rows).

This module is the table, torch-free (`qurl --help`, `qurl plan`); `qurl_mcore.recipe.resolve` turns a choice
of precision, scope and format into the `Recipe` that the trainer and the engines compute with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qurl_mcore.models.registry import hf_linears
from qurl_mcore.models.slots import LINEAR_GROUPS

#: scope -> the linear groups it quantizes (module docstring)
SCOPES: dict[str, frozenset[str]] = {
    "experts": frozenset({"experts", "mlp"}),
    "all": frozenset(LINEAR_GROUPS),
}

FP4_FORMATS = ("nvfp4", "mxfp4", "hif4")


@dataclass(frozen=True)
class RolloutMethod:
    """An SGLang quantization method of the qurl plugin: the quantized-linear mode its forward runs and the
    formats it takes (the first is the default)."""

    name: str
    mode: str
    formats: tuple[str, ...]


#: SGLang method name -> what it computes (`qurl_mcore.sglang` registers exactly these)
METHODS: dict[str, RolloutMethod] = {m.name: m for m in (
    RolloutMethod("qurl_int8", "rc_none", ("int8",)),  # W8A8: per-channel weights, per-token activations
    RolloutMethod("qurl_fp8", "rc_none", ("fp8_e4m3",)),
    RolloutMethod("qurl_fp4", "rc_none", FP4_FORMATS),  # weights and activations on the format's blocks
    RolloutMethod("qurl_fp4_rc", "rc_forward", FP4_FORMATS),  # Y = Q(X)Q(W)ᵀ + Q(X−Q(X))Q(W)ᵀ
)}


@dataclass(frozen=True)
class Precision:
    """One row of `PRECISIONS`.

    `train` is the `qurl_mcore.quant` mode of the trainer's linears in scope ("bf16": full precision, the
    stock Megatron linears); `train_granularity` names the granularity (`qurl_mcore.quant.GRANULARITIES`) of
    weights, activations and gradients, None the format's defaults: "tensor" is one scale per tensor, which
    Transformer Engine's FP8 current scaling runs where it is installed.
    `rollout` is the engines' SGLang method, None for full-precision engines. `kind` says why the row exists.
    `uaq` is the scope UAQ (QuRL §4.3, `uaq.enabled`) rescales on this row, a key of `SCOPES` (`uaq_scope`), None
    where UAQ is refused: "all" for a full-precision trainer of an 8-bit rollout (QuRL), "experts" for FP4 on both
    sides, where it makes the experts' updates larger relative to the FP4 grid that both sides quantize on.
    """

    name: str
    train: str
    rollout: str | None
    kind: str  # "reference" | "QuRL" | "symmetric" | "ablation"
    scope: str  # the default scope
    summary: str
    train_granularity: str | None = None
    uaq: str | None = None

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats this precision runs in (empty for bf16); the first is the default."""
        return METHODS[self.rollout].formats if self.rollout else ()

    @property
    def trains_quantized(self) -> bool:
        return self.train != "bf16"


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16", "bf16", None, "reference", "all",
              "no quantization on either side"),
    Precision("int8", "bf16", "qurl_int8", "QuRL", "all",
              "INT8 W8A8 rollout, full-precision training (QuRL; importance correction, UAQ)", uaq="all"),
    Precision("fp8", "bf16", "qurl_fp8", "QuRL", "all",
              "FP8 E4M3 W8A8 rollout, full-precision training (QuRL)", uaq="all"),
    Precision("fp8_e2e", "rc_none", "qurl_fp8", "ablation", "all",
              "FP8 training (one scale per tensor, Transformer Engine's current scaling) and FP8 W8A8 rollout",
              train_granularity="tensor"),
    Precision("fp4", "rc_none", "qurl_fp4", "symmetric", "experts",
              "FP4 on both sides, no residual correction (MoEResQ's FP4 baseline row)", uaq="experts"),
    Precision("fp4_rc", "rc_both", "qurl_fp4_rc", "symmetric", "experts",
              "FP4 with residual correction in training forward and backward and in rollout (MoEResQ)",
              uaq="experts"),
    Precision("fp4_rc_rollout", "rc_none", "qurl_fp4_rc", "ablation", "experts",
              "residual correction in rollout only (MoEResQ's RC-inference row, RolloutResQ)"),
    Precision("fp4_rc_train", "rc_both", "qurl_fp4", "ablation", "experts",
              "residual correction in training only (MoEResQ's RC-training row)"),
)}

#: MoEResQ Table 2's rows, in its order (`qurl align`)
ALIGNMENT_ROWS = ("bf16", "fp4", "fp4_rc_rollout", "fp4_rc_train", "fp4_rc")


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; use one of {list(PRECISIONS)}") from None


def select(precision: str, scope: str = "auto", fmt: str | None = None) -> tuple[Precision, str, str | None]:
    """(row, scope, format) with the defaults filled in and every choice validated: `scope` "auto" is the
    precision's default, `fmt` None its default format. `qurl_mcore.recipe.resolve` builds the recipe on it."""
    p = get_precision(precision)
    if scope == "auto":
        scope = p.scope
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; use one of {list(SCOPES)} or 'auto'")
    if fmt is None:
        fmt = p.formats[0] if p.formats else None
    elif fmt not in p.formats:
        raise ValueError(f"precision {p.name!r} runs in {list(p.formats) or 'full precision'}, not {fmt!r}")
    return p, scope, fmt


def uaq_scope(precision: str, scope: str = "auto") -> str:
    """The scope UAQ rescales in a run of `precision` that quantizes `scope`: the row's `uaq`, which must hold
    every linear group the run quantizes (a linear quantized on both sides but left unrescaled would keep its
    small updates swallowed, unlike its neighbours). ValueError naming the fix where UAQ does not apply."""
    p, scope, _ = select(precision, scope)
    if p.uaq is None:
        rows = ", ".join(f"{q.name} (scope {q.uaq})" for q in PRECISIONS.values() if q.uaq)
        raise ValueError(f"UAQ rescales the weights that a quantized rollout re-quantizes, for precision {rows}; "
                         f"not precision {p.name!r}: set uaq.enabled=false")
    if not SCOPES[scope] <= SCOPES[p.uaq]:
        left = sorted(SCOPES[scope] - SCOPES[p.uaq])
        raise ValueError(f"UAQ on precision {p.name!r} rescales scope {p.uaq} only, and scope {scope} also "
                         f"quantizes {left}: set scope={p.uaq}, or uaq.enabled=false")
    return p.uaq


def default_scope(method: str) -> str:
    """The scope an engine running `method` takes when none is given: that of the first precision rolling
    out with it (all for qurl_int8/qurl_fp8, experts for the FP4 methods)."""
    return next(p.scope for p in PRECISIONS.values() if p.rollout == method)


def quantizes(scope: str, group: str) -> bool:
    """Whether `scope` quantizes the linears of `group` (a name of `LINEAR_GROUPS`)."""
    if group not in LINEAR_GROUPS:
        raise ValueError(f"unknown linear group {group!r}; use one of {list(LINEAR_GROUPS)}")
    return group in SCOPES[scope]


# ---- the linears of a model, by HF name -------------------------------------------------------------------

def quantized_linears(hf_config: Any, precision: str, scope: str = "auto", side: str = "rollout") -> set[str]:
    """HF module names (without `.weight`) of the linears `precision` quantizes under `scope`, on `side`
    ("rollout" or "train"). Both sides quantize this same set, except that the trainer of a QuRL row
    (int8, fp8) and both sides of bf16 quantize nothing."""
    p, scope, _ = select(precision, scope)
    if side not in ("rollout", "train"):
        raise ValueError(f"side must be 'rollout' or 'train', got {side!r}")
    if (p.rollout is None) if side == "rollout" else not p.trains_quantized:
        return set()
    return {name for name, group in hf_linears(hf_config).items() if quantizes(scope, group)}


def markdown_table() -> str:
    """`PRECISIONS` as the Markdown table of docs/precision.md (a test keeps the doc equal to this)."""
    lines = ["| precision | trainer (quant mode) | rollout (SGLang method) | formats | default scope | kind | what |",
             "|---|---|---|---|---|---|---|"]
    for p in PRECISIONS.values():
        train = "full precision" if not p.trains_quantized else \
            p.train + (f", per {p.train_granularity}" if p.train_granularity else "")
        rollout = f"`{p.rollout}` ({METHODS[p.rollout].mode})" if p.rollout else "full precision"
        lines.append(f"| `{p.name}` | {train} | {rollout} | {', '.join(p.formats) or '—'} | {p.scope} | "
                     f"{p.kind} | {p.summary} |")
    return "\n".join(lines)
