"""Megatron linears whose GEMM is `qurl_mcore.quant.quant_linear`, and a norm usable with sequence parallelism.

`QuantColumnParallelLinear` / `QuantRowParallelLinear` subclass Megatron's own ColumnParallelLinear /
RowParallelLinear and replace only `_forward_impl`, the GEMM with its fused communication. Everything else —
weight sharding and initialisation, `is_expert` handling (no TP communication inside expert linears: the
token dispatcher does it), gather/reduce of outputs, bias handling, checkpoint sharding — stays Megatron's.
The communication Megatron fuses into its GEMM is done around `quant_linear` with Megatron's mappings:

  column, sequence parallel:  X = all-gather_seq(X_shard)      backward: reduce-scatter of dX
  column, TP without SP:      X = X                             backward: all-reduce of dX
  row:                        (none here; Megatron reduces / reduce-scatters the output afterwards)

Scales are computed on each rank's shard, as a TP-sharded inference engine computes them: per-channel weight
scales of a row-parallel weight, per-token scales of its input and NVFP4's tensor scales see only the local
slice. FP4 block scales are unaffected when shard widths are multiples of the block (16 or 32).
With `gradient_accumulation_fusion` the weight gradient still lands in `.grad`; Megatron's DDP hook adds
it to `main_grad`.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from qurl_mcore.quant import QuantLinearSpec, quant_linear


class _QuantGemm:
    """`_forward_impl` for both parallel linears: Megatron passes the same keywords to each."""

    quant: QuantLinearSpec

    def _forward_impl(self, input, weight, bias, *, allreduce_dgrad, sequence_parallel, tp_group, **unused):
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return quant_linear(input, weight, bias, spec=self.quant)


class QuantColumnParallelLinear(_QuantGemm, ColumnParallelLinear):
    """ColumnParallelLinear computing Y = quant_linear(X, W_shard, b_shard; quant). Built by `ModuleSpec`
    with `params={"quant": spec}`; all other arguments are ColumnParallelLinear's."""

    def __init__(self, input_size: int, output_size: int, *, quant: QuantLinearSpec, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.quant = quant


class QuantRowParallelLinear(_QuantGemm, RowParallelLinear):
    """RowParallelLinear computing Y = Σ_ranks quant_linear(X_shard, W_shard; quant) + b."""

    def __init__(self, input_size: int, output_size: int, *, quant: QuantLinearSpec, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.quant = quant


class SequenceParallelNorm:
    """torch RMSNorm/LayerNorm (as Megatron's WrappedTorchNorm builds them) that also allows sequence
    parallelism: the norm is per token, so a sequence shard needs nothing else; its parameters are marked
    `sequence_parallel` so that Megatron's grad finalisation all-reduces their gradients over TP."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused) -> torch.nn.Module:
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r} is not supported; use RMSNorm or LayerNorm")
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
