"""Precision recipes: a name -> the `QuantLinearSpec` every quantized linear of a model runs with.

| recipe | quant_linear mode | default fmt | granularity |
|---|---|---|---|
| bf16 | (stock Megatron linears) | — | — |
| fp8 | naive | fp8_e4m3 | per tensor (TE's current scaling, emulated off GPU) |
| fp4 | naive | nvfp4 | FP4 blocks |
| fp4_rc | rc_both (MoEResQ) | nvfp4 | FP4 blocks |
| fp4_rc_inference | rc_inference (ablation) | nvfp4 | FP4 blocks |
| fp4_rc_training | rc_training (ablation) | nvfp4 | FP4 blocks |
"""
from __future__ import annotations

import importlib.util

import torch

from qurl_mcore.quant import QuantLinearSpec, get_format, make_spec

#: recipe -> quant_linear mode
RECIPES = {
    "bf16": "bf16",
    "fp8": "naive",
    "fp4": "naive",
    "fp4_rc": "rc_both",
    "fp4_rc_inference": "rc_inference",
    "fp4_rc_training": "rc_training",
}
#: which linears a quantized recipe replaces: routed experts only (MoEResQ's default) or also attention
SCOPES = ("experts", "all")


def linear_spec(recipe: str, fmt: str | None = None) -> QuantLinearSpec:
    """The `QuantLinearSpec` of `recipe` with format `fmt` (recipe default if None), validated.

    `fp8` quantizes weights, activations and gradients with one scale per tensor, amax/448 for E4M3: the
    arithmetic of Transformer Engine's FP8 current scaling, so the CPU emulation and the GPU kernels agree.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {list(RECIPES)}")
    mode = RECIPES[recipe]
    if recipe == "bf16":
        if fmt is not None:
            raise ValueError(f"recipe 'bf16' quantizes nothing; drop fmt={fmt!r}")
        return make_spec("bf16")
    if recipe == "fp8":
        fmt = fmt or "fp8_e4m3"
        if not fmt.startswith("fp8"):
            raise ValueError(f"recipe 'fp8' takes fmt fp8_e4m3 or fp8_e5m2, not {fmt!r}")
        return make_spec(mode, fmt, weight_granularity="tensor", act_granularity="tensor", grad_granularity="tensor")
    fmt = fmt or "nvfp4"
    if not get_format(fmt).is_fp4:
        raise ValueError(f"recipe {recipe!r} takes an FP4 format (nvfp4 or mxfp4), not {fmt!r}")
    return make_spec(mode, fmt)


def te_fp8_available() -> bool:
    """Whether the `fp8` recipe runs on Transformer Engine (a CUDA device and TE importable) rather than on
    the `qurl_mcore.quant` emulation."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
