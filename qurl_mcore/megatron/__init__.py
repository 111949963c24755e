"""Megatron-Core integration: CPU compatibility, precision-quantized linears through ModuleSpec, the GPT spec
builder, HF <-> Megatron weights, UAQ, and per-token log-probs. See docs/megatron.md."""
from .convert import export_hf_weights, load_hf_weights, read_hf_state
from .cpu_compat import apply_cpu_compat
from .layers import QuantColumnParallelLinear, QuantRowParallelLinear, SequenceParallelNorm
from .logprobs import TokenLogProbs, token_logprobs
from .gpt import build_gpt, gpt_config
from .parallel import destroy_parallel, init_parallel, spawn
from .spec import gpt_spec, linear_group, quantized_linears
from .rescaling import apply_uaq, quantized_weights, update_capture

__all__ = [
    "QuantColumnParallelLinear", "QuantRowParallelLinear",
    "SequenceParallelNorm", "TokenLogProbs", "apply_cpu_compat", "apply_uaq", "build_gpt", "destroy_parallel",
    "export_hf_weights", "gpt_config", "gpt_spec", "init_parallel", "linear_group", "load_hf_weights",
    "quantized_linears", "quantized_weights", "read_hf_state", "spawn", "token_logprobs", "update_capture",
]
