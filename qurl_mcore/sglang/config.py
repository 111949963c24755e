"""The SGLang `QuantizationConfig` behind every qurl method: which layers get which method."""
from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from .linear import QurlLinearMethod
from .moe import QurlFusedMoEMethod
from .options import QurlOptions

#: Linear layers that stay in the checkpoint's precision under scope "all": MoE routers (MoEResQ keeps them
#: in BF16; a flipped top-k choice costs more than the GEMM saves).
ROUTER_SUFFIXES = (".gate", ".router")


class QurlQuantConfig(QuantizationConfig):
    """Base class of the four registered configs (one per method name, below)."""

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
        if isinstance(layer, FusedMoE):
            return QurlFusedMoEMethod(self.options)
        if isinstance(layer, LinearBase):
            if self.options.scope == "experts" or prefix.endswith(ROUTER_SUFFIXES):
                return UnquantizedLinearMethod()
            return QurlLinearMethod(self.options)
        return None  # embeddings, lm_head: full precision

    def get_scaled_act_names(self) -> list[str]:
        return []


class QurlInt8Config(QurlQuantConfig):
    method = "qurl_int8"


class QurlFp8Config(QurlQuantConfig):
    method = "qurl_fp8"


class QurlFp4Config(QurlQuantConfig):
    method = "qurl_fp4"


class QurlFp4RcConfig(QurlQuantConfig):
    method = "qurl_fp4_rc"


#: method name -> the QuantizationConfig class SGLang instantiates for `--quantization <method>`
CONFIGS: dict[str, type[QurlQuantConfig]] = {
    cls.method: cls for cls in (QurlInt8Config, QurlFp8Config, QurlFp4Config, QurlFp4RcConfig)
}
