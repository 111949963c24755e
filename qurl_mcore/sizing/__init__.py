"""`qurl plan`: the bytes of a run on each GPU, the weight push and the decode ceiling (docs/plan.md)."""
from .memory import (
    GPUS,
    WEIGHT_FORMATS,
    Shape,
    activation_bytes,
    check_fits,
    engine_bytes,
    format_plan,
    hf_tensors,
    layer_activation_bytes,
    local_gpu,
    model_config,
    parameter_count,
    plan,
    push_bytes,
    sglang_reserve,
    trainer_bytes,
)

__all__ = [
    "GPUS", "WEIGHT_FORMATS", "Shape", "activation_bytes", "check_fits", "engine_bytes", "format_plan", "hf_tensors",
    "layer_activation_bytes", "local_gpu", "model_config", "parameter_count", "plan", "push_bytes", "sglang_reserve",
    "trainer_bytes",
]
