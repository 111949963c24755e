"""`GroupedExperts`: an MoE layer's local experts as grouped GEMMs, with the parameters of Megatron's
`SequentialMLP` (the same `local_experts.<i>.linear_fc{1,2}.weight`, so checkpoints, HF conversion, export and
the distributed checkpoint see no difference).

Per projection, the local experts' weights are stacked, quantized in one call (the trainer side of the recipe,
`QuantLinearSpec`; none in full precision) and multiplied with the tokens, which the token dispatcher delivers
sorted by expert, in one grouped GEMM (`qurl_mcore.quant.grouped`):

  H = act(Q̃(X) · Q(W1_e)ᵀ) · p          per token of expert e (p: its routing probability)
  Y = Q̃(H) · Q(W2_e)ᵀ

the numbers of `SequentialMLP` over the same quantized linears (quantization is per token, `row_grouped`
granularities). Recipes whose activations share a scale across tokens (per-tensor) keep `SequentialMLP`
(`qurl_mcore.stack.experts`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP

from qurl_mcore.quant import QuantLinearSpec, quant_linear
from qurl_mcore.quant.grouped import Groups

#: the spec of an expert linear that is not quantized (Megatron's own ColumnParallel/RowParallelLinear)
FULL_PRECISION = QuantLinearSpec()


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts (built by it from the same submodules), run as grouped GEMMs (module docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if self.config.add_bias_linear:
            raise ValueError("GroupedExperts runs experts without biases; set add_bias_linear=False or build "
                             "SequentialMLP experts (gpt_spec(experts='sequential'))")
        if self.config.use_te_activation_func or not self.config.gated_linear_unit:
            raise ValueError("GroupedExperts computes Megatron's gated activation (gated_linear_unit=True, "
                             "use_te_activation_func=False); build SequentialMLP experts for others")
        first = self.local_experts[0]
        self.specs = tuple(getattr(linear, "quant", FULL_PRECISION) for linear in (first.linear_fc1,
                                                                                   first.linear_fc2))

    def _stacked(self, name: str) -> torch.Tensor:
        return torch.stack([getattr(expert, name).weight for expert in self.local_experts])

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """act(h)·p as Megatron's MLP computes it (its fused SwiGLU where the config fuses it)."""
        config = self.config
        if config.bias_activation_fusion and config.activation_func is F.silu:
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
        gate, linear = torch.chunk(h, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(min=None, max=val), linear.clamp(min=-val, max=val)
        out = config.activation_func(gate) * (linear + config.glu_linear_offset)
        return (out * probs.unsqueeze(-1)).to(out.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: the probabilities scale the input instead
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        groups = Groups.of(tokens_per_expert, x.device)
        fc1, fc2 = self.specs
        h = quant_linear(x, self._stacked("linear_fc1"), spec=fc1, groups=groups)
        y = quant_linear(self._activation(h, probs), self._stacked("linear_fc2"), spec=fc2, groups=groups)
        return y, None
