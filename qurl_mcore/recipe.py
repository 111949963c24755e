"""The recipe: a precision, scope and format resolved once into what the trainer and the engines compute.

`resolve(precision, scope, fmt)` reads the precision table (`qurl_mcore.precision`) once and returns a frozen
`Recipe`; the model builders (`qurl_mcore.megatron.gpt_spec`, `build_gpt`) take it and nothing downstream
looks a precision up by name again:

  precision, scope, fmt   the row, with the scope and format defaults filled in and checked
  format                  the format's facts (`qurl_mcore.quant.FormatSpec`), None for full precision
  train, train_groups     the trainer's `QuantLinearSpec` and the linear groups it applies to (none for the
                          trainer of a QuRL row and for bf16: full precision, the stock linears)
  te                      whether Transformer Engine runs the trainer's GEMMs: a per-tensor training spec
                          (FP8 current scaling) where TE is installed on a CUDA device
  engine                  the engines' half (`EngineRecipe`: SGLang method, its spec, its groups), None for
                          full-precision engines

The loop's driver resolves the run's recipe once (`qurl_mcore.loop.actors.start_actors`) and hands it to every
trainer rank and, as the SGLang method and options it decides (`qurl_mcore.loop.sampler.engine_config`), to every
engine. An engine process cannot receive Python objects through SGLang's arguments: it rebuilds its half with
`engine_recipe` from that method and options, a pure function of them, so it equals `Recipe.engine`
(`qurl_mcore.sglang.options.QurlOptions.recipe`). A trainer rank checks that it can run what it received
(`check_runnable`) and resolves nothing.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .models.slots import LINEAR_GROUPS
from .precision import METHODS, SCOPES, Precision, default_scope, quantizes, select
from .quant import FormatSpec, PerTensor, QuantLinearSpec, get_format, make_spec


def te_fp8_available(cuda: bool | None = None) -> bool:
    """Whether FP8 training runs on Transformer Engine (a CUDA device and TE importable) rather than on the
    `qurl_mcore.quant` emulation. `cuda` None asks this process for a device; a driver without one passes
    whether its trainers have GPUs (every node of a run has the same software: Ray requires it)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return cuda and importlib.util.find_spec("transformer_engine") is not None


def scope_groups(scope: str) -> frozenset[str]:
    """The linear groups (`qurl_mcore.models.slots.LINEAR_GROUPS`) that `scope` quantizes."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; use one of {list(SCOPES)}")
    return frozenset(g for g in LINEAR_GROUPS if quantizes(scope, g))


@dataclass(frozen=True)
class EngineRecipe:
    """What an SGLang engine running `method` computes: `spec` (the trainer's numerics, forward only) in
    format `fmt` on the linears of `groups` (those `scope` quantizes)."""

    method: str
    fmt: str
    scope: str
    format: FormatSpec
    spec: QuantLinearSpec
    groups: frozenset[str]


@dataclass(frozen=True)
class Recipe:
    """A resolved precision (module docstring)."""

    precision: Precision
    scope: str
    fmt: str | None
    format: FormatSpec | None
    train: QuantLinearSpec
    train_groups: frozenset[str]
    te: bool
    engine: EngineRecipe | None

    def groups(self, side: str) -> frozenset[str]:
        """The linear groups `side` ("rollout" or "train") quantizes."""
        if side not in ("rollout", "train"):
            raise ValueError(f"side must be 'rollout' or 'train', got {side!r}")
        if side == "train":
            return self.train_groups
        return self.engine.groups if self.engine else frozenset()


def engine_recipe(method: str, fmt: str | None = None, scope: str | None = None) -> EngineRecipe:
    """The engines' half for SGLang method `method` (a key of `qurl_mcore.precision.METHODS`); `fmt` None is
    the method's default format, `scope` None that of the first precision rolling out with it."""
    m = METHODS.get(method)
    if m is None:
        raise ValueError(f"unknown qurl quantization method {method!r}; use one of {list(METHODS)}")
    fmt = fmt or m.formats[0]
    if fmt not in m.formats:
        raise ValueError(f"{method} runs in {list(m.formats)}, not {fmt!r}")
    scope = scope or default_scope(method)
    return EngineRecipe(method, fmt, scope, get_format(fmt), make_spec(m.mode, fmt), scope_groups(scope))


def check_runnable(recipe: Recipe) -> None:
    """Refuse, in the process that builds the model, a recipe whose trainer runs on Transformer Engine where TE
    cannot run (no CUDA device, or TE not installed on this node)."""
    if recipe.te and not te_fp8_available():
        raise RuntimeError(f"precision {recipe.precision.name!r} trains on Transformer Engine, which this process "
                           f"cannot run (CUDA device: {torch.cuda.is_available()}, transformer_engine importable: "
                           f"{importlib.util.find_spec('transformer_engine') is not None}): install "
                           "requirements/gpu-te.txt on every node of the run")


def resolve(precision: str, scope: str = "auto", fmt: str | None = None, *,
            te_available: bool | None = None) -> Recipe:
    """The recipe of `precision` under `scope` ("auto": the precision's default) in `fmt` (None: its default
    format). `te_available` None asks this process (`te_fp8_available`): resolve where the model is built."""
    p, scope, fmt = select(precision, scope, fmt)
    if p.trains_quantized:
        g = p.train_granularity
        train = make_spec(p.train, fmt, weight_granularity=g, act_granularity=g, grad_granularity=g)
    else:
        train = make_spec("bf16")
    per_tensor = train.quantized and isinstance(train.weight_granularity, PerTensor)
    te = per_tensor and (te_fp8_available() if te_available is None else te_available)
    return Recipe(
        precision=p, scope=scope, fmt=fmt, format=get_format(fmt) if fmt else None, train=train,
        train_groups=scope_groups(scope) if train.quantized else frozenset(), te=te,
        engine=engine_recipe(p.rollout, fmt, scope) if p.rollout else None,
    )
