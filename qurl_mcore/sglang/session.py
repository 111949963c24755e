"""The weight-update session on an SGLang without one (0.5.15.post1, which slime's image pins).

SGLang 0.5.23 brackets a push with begin_weight_update / end_weight_update: its loader calls every quantized
layer's `restore_weights_before_loading` before the first bucket and `process_weights_after_loading` after the
last (weights.py has the cycle). SGLang 0.5.15 has neither. There a push loads into the model's parameters as
they are, and a qurl layer, whose full-precision weight waits apart as its master, takes nothing: the push
reports success and the engine keeps serving the old weights. So on such an SGLang each update call becomes a
session of its own, through SGLang's plugin hooks: restore before the call, re-quantize after it. A bucketed
push then re-quantizes the whole model once per bucket (slime sends one per `--update-weight-buffer-size`):
that costs time, never correctness.
"""
from __future__ import annotations

from typing import Any, Callable

from sglang.srt.model_loader.loader import DefaultModelLoader
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .linear import QurlLinearMethod
from .moe import QurlFusedMoEMethod

RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
UPDATE_CALLS = ("update_weights_from_tensor", "update_weights_from_distributed")  # both end in model.load_weights

_registered = False


def sglang_has_sessions() -> bool:
    """Whether SGLang's own loader restores quantized weights before an update (0.5.23 does, 0.5.15 does not)."""
    return hasattr(DefaultModelLoader, "restore_weights_before_loading")


def register() -> None:
    """On an SGLang without sessions, make each of its update calls one (applied by SGLang's `load_plugins`
    after the plugins ran, in every process that builds a model runner). Idempotent; a no-op on 0.5.23."""
    global _registered
    if _registered or sglang_has_sessions():
        return
    for call in UPDATE_CALLS:
        HookRegistry.register(f"{RUNNER}.{call}", each_call_a_session, HookType.AROUND)
    _registered = True


def each_call_a_session(original: Callable, runner: Any, *args, **kwargs):
    """`original(runner, ...)` between the restore and the re-quantization of every qurl layer. The layers are
    re-quantized even when the call fails, so the engine serves a quantized copy of whatever its masters hold
    (SGLang's own message then says the weights are partially updated)."""
    layers = [(m, m.quant_method) for m in runner.model.modules()
              if isinstance(getattr(m, "quant_method", None), (QurlLinearMethod, QurlFusedMoEMethod))]
    for module, method in layers:
        method.restore_weights_before_loading(module)
    try:
        return original(runner, *args, **kwargs)
    finally:
        for module, method in layers:
            method.process_weights_after_loading(module)
