"""`qurl plan`: the bytes of a run on each GPU, the weight push and the decode ceiling, before a GPU hour is
spent. Pure functions over a model shape (an HF config.json as a dict) and a `Config`; importing this package
imports neither Megatron nor SGLang (torch only for the formats' facts, `quant.formats`). docs/plan.md states every formula with its source and compares the numbers with
published ones.

  gpus      the GPU catalogue and the links a weight push can cross
  tensors   the model's tensors in push order, from its architecture table
  memory    a trainer rank's bytes (states, activations) and an engine GPU's (weights, masters, KV, reserve)
  speed     a weight push's bytes and seconds, and an engine's decode ceiling
  verdict   whether each kind of GPU fits, the levers that make it fit, and the whole `Plan`
  report    the plan as the lines `qurl plan` prints
"""
from .gpus import GPUS, local_gpu
from .memory import (activation_bytes, batch_bytes, engine_bytes, layer_activation_bytes, sglang_reserve,
                     trainer_bytes)
from .report import format_plan
from .speed import push_bytes
from .tensors import hf_tensors, model_config, parameter_count
from .verdict import check_fits, size_run

__all__ = [
    "GPUS", "activation_bytes", "batch_bytes", "check_fits", "engine_bytes", "format_plan", "hf_tensors",
    "layer_activation_bytes", "local_gpu", "model_config", "parameter_count", "push_bytes", "sglang_reserve",
    "size_run", "trainer_bytes",
]
