"""The SGLang `QuantizationConfig` behind every qurl method: which layers get which method.

A layer is quantized when its linear group is in the method's scope, the same rule the trainer's `gpt_spec`
follows. Which SGLang module holds which HF weights, and their group, is the `sglang` of each slot in the
architecture table (`qurl_mcore.models`): SGLang packs q/k/v and gate/up as Megatron does, and a layer's routed
experts are one FusedMoE. Every other linear (the router, anything a table does not name) keeps the
checkpoint's precision, as do embeddings and lm_head.

With `$QURL_QUANTIZED_LOG` set, every process of the engine appends the HF module names (without `.weight`)
of each linear it quantizes to that file, one per line: the loop compares them with the trainer's set
before the first step (`qurl_mcore.precision.quantized_linears` is what both must equal).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from qurl_mcore.models.registry import sglang_linears
from qurl_mcore.precision import METHODS, quantizes

from .architecture import checkpoint_prefix
from .linear import QurlLinearMethod
from .moe import QurlFusedMoEMethod
from .options import QUANTIZED_LOG_ENV, QurlOptions


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
        scope, prefix = self.options.scope, checkpoint_prefix(prefix)
        if isinstance(layer, FusedMoE):
            if not quantizes(scope, "experts"):
                return None  # SGLang's unquantized MoE method
            role = sglang_linears(prefix, layer.num_experts)
            if role is None:
                raise ValueError(f"{prefix}: a FusedMoE that no architecture table names (qurl_mcore.models)")
            _log(role[1])
            return QurlFusedMoEMethod(self.options)
        if isinstance(layer, LinearBase):
            role = sglang_linears(prefix)
            if role is None or not quantizes(scope, role[0]):
                return UnquantizedLinearMethod()
            _log(role[1])
            return QurlLinearMethod(self.options)
        return None  # embeddings, lm_head: full precision

    def get_scaled_act_names(self) -> list[str]:
        return []

    def can_fuse_shared_expert(self) -> bool:
        """Never, whatever the scope. SGLang's fusion (CUDA, SM >= 80, EP 1) makes the shared expert routed
        expert E of the layer's FusedMoE (E+1 experts, top-k+1): it would take the routed experts' method
        (quantized under scope "experts", which keeps shared experts full precision) and be quantized, logged
        and pushed under an expert name no architecture table has, while the trainer (Megatron's shared-expert
        MLP) and the symmetry check hold it as linears of its own. DeepSeek's gate asks this; GLM's does not
        (the engine's server arguments turn fusion off for it: `EngineConfig.engine_kwargs`)."""
        return False


#: method name -> the QuantizationConfig class SGLang instantiates for `--quantization <method>`
CONFIGS: dict[str, type[QurlQuantConfig]] = {
    name: type(f"QurlConfig_{name}", (QurlQuantConfig,), {"method": name}) for name in METHODS
}
