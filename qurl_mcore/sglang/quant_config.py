"""The SGLang `QuantizationConfig` behind every qurl method: which layers get which method.

A layer is quantized when its linear group (`qurl_mcore.precision.GROUPS`) is in the method's scope, the
same rule the trainer's `gpt_spec` follows. SGLang's module prefixes, by group:

  attention       model.layers.{i}.self_attn.qkv_proj, .o_proj
  mlp             model.layers.{i}.mlp.gate_up_proj, .down_proj       (dense models)
  experts         model.layers.{i}.mlp.experts                         (FusedMoE: every routed expert)
  shared_experts  model.layers.{i}.mlp.shared_expert.gate_up_proj, .down_proj
Every other linear (the router `mlp.gate`, anything an unsupported architecture adds) keeps the
checkpoint's precision, as do embeddings and lm_head.

With `$QURL_QUANTIZED_LOG` set, every process of the engine appends the HF module names (without `.weight`)
of each linear it quantizes to that file, one per line: the loop compares them with the trainer's set
before the first step (`qurl_mcore.precision.quantized_linears` is what both must equal).
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from qurl_mcore.precision import METHODS, quantizes

from .linear import QurlLinearMethod
from .moe import QurlFusedMoEMethod
from .options import QUANTIZED_LOG_ENV, QurlOptions

#: SGLang linear prefix -> (group, the HF modules it packs)
_LINEARS = tuple((re.compile(p), g, hf) for p, g, hf in (
    (r"\.self_attn\.qkv_proj$", "attention", ("q_proj", "k_proj", "v_proj")),
    (r"\.self_attn\.o_proj$", "attention", ("o_proj",)),
    (r"\.mlp\.shared_expert\.gate_up_proj$", "shared_experts", ("gate_proj", "up_proj")),
    (r"\.mlp\.shared_expert\.down_proj$", "shared_experts", ("down_proj",)),
    (r"\.mlp\.gate_up_proj$", "mlp", ("gate_proj", "up_proj")),
    (r"\.mlp\.down_proj$", "mlp", ("down_proj",)),
))


def linear_role(prefix: str) -> tuple[str, list[str]] | None:
    """(group, HF module names) of an SGLang linear layer's prefix; None for linears no scope quantizes."""
    for pattern, group, hf in _LINEARS:
        if pattern.search(prefix):
            base = prefix.rsplit(".", 1)[0]
            return group, [f"{base}.{name}" for name in hf]
    return None


def _log(names: list[str]) -> None:
    path = os.environ.get(QUANTIZED_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write("".join(f"{n}\n" for n in names))


class QurlQuantConfig(QuantizationConfig):
    """Base class of the registered configs (one per method name of `qurl_mcore.precision.METHODS`)."""

    method: str = ""

    def __init__(self, options: QurlOptions | None = None):
        super().__init__()
        self.options = options or QurlOptions.parse(self.method)

    def get_name(self) -> str:
        return self.method

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # emulation runs anywhere; the CUDA kernels check their own support

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # BF16 checkpoints carry no quantization files

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QurlQuantConfig":
        return cls(QurlOptions.parse(cls.method, config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        scope = self.options.scope
        if isinstance(layer, FusedMoE):
            if not quantizes(scope, "experts"):
                return None  # SGLang's unquantized MoE method
            _log([f"{prefix}.{e}.{p}" for e in range(layer.num_experts) for p in ("gate_proj", "up_proj", "down_proj")])
            return QurlFusedMoEMethod(self.options)
        if isinstance(layer, LinearBase):
            role = linear_role(prefix)
            if role is None or not quantizes(scope, role[0]):
                return UnquantizedLinearMethod()
            _log(role[1])
            return QurlLinearMethod(self.options)
        return None  # embeddings, lm_head: full precision

    def get_scaled_act_names(self) -> list[str]:
        return []


#: method name -> the QuantizationConfig class SGLang instantiates for `--quantization <method>`
CONFIGS: dict[str, type[QurlQuantConfig]] = {
    name: type(f"QurlConfig_{name}", (QurlQuantConfig,), {"method": name}) for name in METHODS
}
