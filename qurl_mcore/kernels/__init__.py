"""Triton kernels of the quantized numerics, each the same function as its `qurl_mcore.quant` reference up to
the order of fp32 sums: the fused FP4 MoE experts and the dense FP4 linear (`fp4_moe`). Importing this
package imports no Triton; `serves` says where the kernels run."""
from __future__ import annotations

import importlib.util

import torch

from qurl_mcore.quant.formats import TRITON_FP4, get_format
from qurl_mcore.quant.granularity import PerBlock
from qurl_mcore.quant.linear import QuantLinearSpec


def serves(spec: QuantLinearSpec, device: torch.device) -> bool:
    """Whether the FP4 kernels compute `spec`'s forward on `device`: CUDA with Triton, a format that names
    them (`FormatSpec.kernels`), weights and activations on the format's own 1 x block blocks."""
    if not spec.quantized or device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    fmt = get_format(spec.fmt)
    native = PerBlock((1, fmt.block)) if fmt.block else None
    return TRITON_FP4 in fmt.kernels and spec.weight_granularity == native == spec.act_granularity
