"""Quantization numerics shared by the trainer (Megatron) and the rollout engine (SGLang). Pure torch."""
from .fake import fake_quantize, residual_fake_quantize, residual_quantize
from .formats import E2M1_GRID, FORMATS, Family, FormatSpec, ScaleEncoding, get_format
from . import hif4
from .gemm import quantized_matmul, select_backend
from .granularity import (
    ACT_BLOCK, GRANULARITIES, WEIGHT_BLOCK, Granularity, PerBlock, PerRow, PerTensor, PerToken, as_granularity,
)
from .linear import (
    MODES,
    QuantLinearSpec,
    make_spec,
    quant_linear,
    quantize_activation,
    quantize_weight,
    quantize_weight_compiled,
    quantized_linear,
)
from .qtensor import QTensor, quantize

__all__ = [
    "ACT_BLOCK", "E2M1_GRID", "FORMATS", "Family", "FormatSpec", "GRANULARITIES", "Granularity", "MODES", "PerBlock",
    "PerRow", "PerTensor", "PerToken", "QTensor", "QuantLinearSpec", "ScaleEncoding", "WEIGHT_BLOCK",
    "as_granularity", "fake_quantize", "hif4", "get_format", "make_spec", "quant_linear", "quantize", "quantize_activation",
    "quantize_weight", "quantize_weight_compiled", "quantized_linear", "quantized_matmul", "residual_fake_quantize",
    "residual_quantize", "select_backend",
]
