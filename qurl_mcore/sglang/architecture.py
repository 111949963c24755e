"""Which SGLang model class builds a checkpoint under a qurl method (Mixtral's FusedMoE class, as unquantized),
and the checkpoint name of a module it builds.

SGLang 0.5.23's `get_model_architecture` builds a Mixtral under any quantization method outside its own short
list (fp8, compressed-tensors, a few int4 ones) as `QuantMixtralForCausalLM`: every expert's w1, w3, w2 a linear
of its own, routed with torch.topk outside SGLang's `TopK`. That class never captures its routing (the capture
of `return_routed_experts` stays zeros, so no top-k match and no R3) and on a GPU runs no fused MoE kernel. The
qurl methods quantize a FusedMoE's experts (`moe.QurlFusedMoEMethod`), so a qurl Mixtral is built as the
unquantized one is, `MixtralForCausalLM`: routing in `TopK` (captured), experts in one FusedMoE.
"""
from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .options import METHODS

TARGET = "sglang.srt.model_loader.utils.get_model_architecture"
#: the class SGLang substitutes for a quantized checkpoint's architecture -> the one a qurl method builds
FUSED_MOE_CLASSES = {"QuantMixtralForCausalLM": "MixtralForCausalLM"}

_registered = False


def register() -> None:
    """Hook `get_model_architecture` (applied by SGLang's `load_plugins`, in every process that loads a model).
    Idempotent."""
    global _registered
    if not _registered:
        HookRegistry.register(TARGET, fused_moe_class, HookType.AFTER)
        _registered = True


def fused_moe_class(result: tuple[type, str], model_config: Any, *args, **kwargs) -> tuple[type, str] | None:
    """`FUSED_MOE_CLASSES[arch]` in place of the class SGLang chose for a qurl method, else None (SGLang's
    choice stands). The resolved name is recorded on the config as SGLang's own resolution does."""
    from sglang.srt.models.registry import ModelRegistry

    _, arch = result
    if arch not in FUSED_MOE_CLASSES or model_config.quantization not in METHODS:
        return None
    model_cls, arch = ModelRegistry.resolve_model_cls([FUSED_MOE_CLASSES[arch]])
    model_config._resolved_model_arch = arch
    return model_cls, arch


def checkpoint_prefix(prefix: str) -> str:
    """The checkpoint's name of the SGLang module at `prefix`: SGLang 0.5.23's `MixtralModel` builds its layers
    under "layers.{i}", not under its own "model." as the checkpoint (and every other model class) names them."""
    return "model." + prefix if prefix.startswith("layers.") else prefix
