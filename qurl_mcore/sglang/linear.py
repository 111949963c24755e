"""SGLang linear method: BF16 weights or the trainer's codes in, `qurl_mcore.quant` numerics out (see weights.py
for the refit cycle)."""
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
        if weights.detach_codes(layer) or not weights.is_loaded(layer, "weight"):
            return  # a code push installed its codes, or nothing was restored since the last quantization
        fresh = self.quantize_weight(weights.at_home(layer, "weight", layer.weight.data), self.spec)
        layer.qurl_weight = weights.store(getattr(layer, "qurl_weight", None), fresh)
        if self.options.codes:
            weights.release(layer, "weight")
        else:
            weights.detach_master(layer, "weight", host=self.options.master == "host")

    def restore_weights_before_loading(self, layer) -> None:
        if self.options.codes:  # SGLang's own loader shards codes and scales by rows and columns as it does W
            # here only: slime's SGLang has neither this helper nor `tp_group`, and takes no code pushes
            from sglang.srt.distributed.utils import get_group_rank_size

            rank, _ = get_group_rank_size(layer.tp_group)
            weights.attach_codes(layer, "weight", layer.qurl_weight, layer.weight_loader, weights.rank_of(rank))
        else:
            weights.attach_master(layer, "weight")

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        wq = layer.qurl_weight
        if self.options.kernel == "auto":
            if kernels.linear_available(wq.spec, x.device):
                return kernels.w8a8_linear(x, wq, bias)
            if fp4_kernels.serves(self.spec, x.device):
                return fp4_linear(x, wq, bias, self.spec)
        return quantized_linear(x, wq, bias, self.spec)
