"""SGLang linear method: BF16 weights in, `qurl_mcore.quant` numerics out (see weights.py for the refit cycle)."""
from __future__ import annotations

import torch
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.utils import set_weight_attrs

from qurl_mcore import kernels as fp4_kernels
from qurl_mcore.kernels.fp4_moe import fp4_linear
from qurl_mcore.quant import quantized_linear

from . import kernels, weights
from .options import REQUANTS, QurlOptions


class QurlLinearMethod(LinearMethodBase):
    """Y = Q̃(X)·Q(W)ᵀ + b, with Q(W) = quantize_weight(W, spec) refreshed after every (partial) update and
    Q̃ = Q or RC on activations as the spec says: the trainer's `quant_linear` forward. On CUDA (`kernel: auto`)
    INT8/FP8 take SGLang's W8A8 kernels and FP4 the FP4 Triton GEMM (`qurl_mcore.kernels`)."""

    def __init__(self, options: QurlOptions):
        self.options = options
        self.spec = options.recipe.spec
        self.quantize_weight = REQUANTS[options.requant]

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight = torch.nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer) -> None:
        if not weights.is_loaded(layer, "weight"):
            return  # already quantized and nothing was restored since
        fresh = self.quantize_weight(weights.at_home(layer, "weight", layer.weight.data), self.spec)
        layer.qurl_weight = weights.store(getattr(layer, "qurl_weight", None), fresh)
        weights.detach_master(layer, "weight", host=self.options.master == "host")

    def restore_weights_before_loading(self, layer) -> None:
        weights.attach_master(layer, "weight")

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        wq = layer.qurl_weight
        if self.options.kernel == "auto":
            if kernels.linear_available(wq.spec, x.device):
                return kernels.w8a8_linear(x, wq, bias)
            if fp4_kernels.serves(self.spec, x.device):
                return fp4_linear(x, wq, bias, self.spec)
        return quantized_linear(x, wq, bias, self.spec)
