"""What a qurl quantization method does, parsed from SGLang's engine arguments (no SGLang import here).

The method names and what they compute are rows of `qurl_mcore.precision.METHODS` (the table shared with
the trainer); `QurlOptions.recipe` is what the engine computes, built once per engine by
`qurl_mcore.recipe.engine_recipe(method, fmt, scope)`, equal to the trainer's `Recipe.engine`:

  qurl_int8    W8A8 INT8: per-channel weights, per-token activations      mode rc_none, int8
  qurl_fp8     W8A8 FP8 E4M3, same granularity                            mode rc_none, fp8_e4m3
  qurl_fp4     FP4 weights and activations on their own blocks            mode rc_none, nvfp4 | mxfp4 | hif4
  qurl_fp4_rc  FP4 with residual-corrected activations, Y = Q(X)Q(W)ᵀ + Q(X-Q(X))Q(W)ᵀ
                                                                          mode rc_forward, nvfp4 | mxfp4 | hif4
(`rc_forward` and `rc_both` share this forward; the rollout engine only runs forwards.)

Options (keys of the model's `quantization_config`, set from the engine with
`json_model_override_args='{"quantization_config": {"quant_method": "qurl_fp4_rc", "fmt": "mxfp4"}}'`):
  fmt     FP4 methods only: "nvfp4" (default), "mxfp4" or "hif4" (no kernel: emulated on every device).
  scope   "all" or "experts" (`qurl_mcore.precision.SCOPES`); default: the scope of the precision that
          rolls out with this method (all for qurl_int8/qurl_fp8, experts for the FP4 methods).
          Routers, embeddings and lm_head always stay in the checkpoint's precision.
  kernel  "auto" (default: on CUDA SGLang's INT8/FP8 GEMM kernels and qurl_mcore.kernels' FP4 kernels,
          qurl_mcore.quant elsewhere) or "qurl" (always qurl_mcore.quant's emulation: bitwise the trainer's
          forward).
  master  where the full-precision weights wait between updates: "host" (default, CPU memory) or
          "device" (no copies per update, but full-precision memory stays on the accelerator).
  push    what a weight update carries: "bf16" (default: full-precision weights, re-quantized after the
          update from masters the engine keeps) or "codes" (the trainer's codes and scales,
          `qurl_mcore.quant.wire`, installed in place: no master, no re-quantization; the checkpoint
          itself still loads in full precision and is quantized once, routed experts as they load).
  requant how each update re-quantizes the weights: "eager" (default, `quantize_weight`) or "compiled"
          (`quantize_weight_compiled`: torch.compile fuses it, bitwise the same codes; the engine's first
          update per format compiles, seconds on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from qurl_mcore.precision import METHODS, SCOPES, default_scope
from qurl_mcore.quant import quantize_weight, quantize_weight_compiled
from qurl_mcore.recipe import EngineRecipe, engine_recipe

KERNELS = ("auto", "qurl")
#: a file every engine process appends the HF names of the linears it quantized to (sglang/quant_config.py)
QUANTIZED_LOG_ENV = "QURL_QUANTIZED_LOG"
MASTERS = ("host", "device")
#: what a weight update carries (the `push` option)
PUSHES = ("bf16", "codes")
#: how an engine re-quantizes pushed weights: the quantizer each name calls
REQUANTS = {"eager": quantize_weight, "compiled": quantize_weight_compiled}
#: the options a `quantization_config` may set
_OPTIONS = ("fmt", "scope", "kernel", "master", "requant", "push")
#: Keys SGLang itself adds to the dict it hands to `from_config`.
_SGLANG_KEYS = {"quant_method", "packed_modules_mapping", "hf_config"}


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"qurl quantization option {name}={value!r} is invalid; use one of {list(allowed)}")
    return value


@dataclass(frozen=True)
class QurlOptions:
    """A validated method plus options: `recipe` is what the engine computes (its `spec` is the
    QuantLinearSpec the trainer uses for the same layers), the rest how it runs."""

    recipe: EngineRecipe
    kernel: str = "auto"
    master: str = "host"
    requant: str = "eager"
    push: str = "bf16"

    @property
    def codes(self) -> bool:
        """Whether updates carry codes (no masters kept)."""
        return self.push == "codes"

    @property
    def method(self) -> str:
        return self.recipe.method

    @property
    def fmt(self) -> str:
        return self.recipe.fmt

    @property
    def scope(self) -> str:
        return self.recipe.scope

    @classmethod
    def parse(cls, method: str, config: Mapping[str, Any] | None = None) -> "QurlOptions":
        """From a method name and the (possibly empty) `quantization_config` dict."""
        if method not in METHODS:
            raise ValueError(f"unknown qurl quantization method {method!r}; use one of {list(METHODS)}")
        config = dict(config or {})
        declared = config.get("quant_method", method)
        if declared != method:
            raise ValueError(f"quantization_config names {declared!r} but the engine runs {method!r}")
        unknown = set(config) - _SGLANG_KEYS - set(_OPTIONS)
        if unknown:
            raise ValueError(f"unknown qurl quantization option(s) {sorted(unknown)}; use {', '.join(_OPTIONS)}")
        formats = METHODS[method].formats
        if len(formats) == 1 and config.get("fmt", formats[0]) != formats[0]:
            raise ValueError(f"{method} always uses {formats[0]}; drop fmt={config['fmt']!r}")
        fmt = _choice("fmt", config.get("fmt", formats[0]), formats)
        scope = _choice("scope", config.get("scope", default_scope(method)), tuple(SCOPES))
        return cls(
            engine_recipe(method, fmt, scope),
            kernel=_choice("kernel", config.get("kernel", "auto"), KERNELS),
            master=_choice("master", config.get("master", "host"), MASTERS),
            requant=_choice("requant", config.get("requant", "eager"), tuple(REQUANTS)),
            push=_choice("push", config.get("push", "bf16"), PUSHES),
        )

    def override_args(self) -> dict[str, Any]:
        """The `json_model_override_args` dict that selects exactly these options in an engine."""
        return {"quantization_config": {"quant_method": self.method, **{k: getattr(self, k) for k in _OPTIONS}}}
