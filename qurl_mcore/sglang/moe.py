"""SGLang FusedMoE method: each expert's gate/up (w13) and down (w2) projections run `qurl_mcore.quant`'s
quantized linear, with one `quantize_weight` per expert matrix (the trainer quantizes per-expert weights)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from qurl_mcore.quant import QTensor, QuantLinearSpec, quantize_weight, quantized_linear

from . import kernels, weights
from .options import QurlOptions

_WEIGHTS = ("w13_weight", "w2_weight")


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: list[QTensor],
                    w2: list[QTensor], spec: QuantLinearSpec) -> torch.Tensor:
    """out[t] = Σ_j p[t, j] · Q̃(silu(g) ⊙ u)·Q(W2_e)ᵀ with [g; u] = Q̃(x_t)·Q(W13_e)ᵀ and e = topk_ids[t, j]
    (gate rows first in W13, as in the checkpoint's gate_proj/up_proj and Megatron's fc1). Tokens routed to
    ids outside [0, E) (padding, other EP ranks) contribute nothing; the weighted sum is taken in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < len(w13):
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = quantized_linear(x[tok], w13[e], None, spec).chunk(2, dim=-1)
        y = quantized_linear(F.silu(gate) * up, w2[e], None, spec)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


class QurlFusedMoEMethod(FusedMoEMethodBase):
    """MoE experts with BF16 weights in and quantized experts out; refits like the linear method (weights.py)."""

    def __init__(self, options: QurlOptions):
        super().__init__()
        self.options = options
        self.spec = options.spec()
        self.runner = None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       with_bias: bool = False, **extra_weight_attrs):
        if with_bias:
            raise NotImplementedError("qurl quantization does not support MoE expert biases")
        if not layer.moe_runner_config.is_gated:
            raise NotImplementedError("qurl quantization supports gated (gate/up) MoE experts only")
        inter = intermediate_size_per_partition
        shapes = {"w13_weight": (num_experts, 2 * inter, hidden_size), "w2_weight": (num_experts, hidden_size, inter)}
        for name, shape in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        # The Triton runner serves the GPU kernel path; like SGLang's unquantized method we also create it on
        # CPU, where it only declares the standard top-k contract (apply() then never calls it).
        self.runner = MoeRunner(MoeRunnerBackend.TRITON, moe_runner_config)

    def _use_kernels(self, device: torch.device) -> bool:
        return self.options.kernel == "auto" and kernels.available(self.options.fmt, device)

    def process_weights_after_loading(self, layer) -> None:
        if not all(weights.is_loaded(layer, n) for n in _WEIGHTS):
            return
        device = weights.home(layer, "w13_weight")
        for name in _WEIGHTS:
            w = getattr(layer, name).data
            fresh = [quantize_weight(weights.at_home(layer, name, w[e]), self.spec) for e in range(w.shape[0])]
            old = getattr(layer, f"qurl_{name}", None)
            if old is None:
                if self._use_kernels(device):  # stacked storage for the fused kernel, experts as views of it
                    codes, scales, fresh = weights.stack(fresh)
                    setattr(layer, f"qurl_{name}_stacked", (codes, scales))
                setattr(layer, f"qurl_{name}", fresh)
            else:
                setattr(layer, f"qurl_{name}", [weights.store(o, f) for o, f in zip(old, fresh)])
            weights.detach_master(layer, name, host=self.options.master == "host")

    def restore_weights_before_loading(self, layer) -> None:
        for name in _WEIGHTS:
            weights.attach_master(layer, name)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        if self._use_kernels(x.device):
            (w13, s13), (w2, s2) = layer.qurl_w13_weight_stacked, layer.qurl_w2_weight_stacked
            return self.runner.run(dispatch_output, kernels.moe_quant_info(self.options.fmt, w13, s13, w2, s2))
        config = self.moe_runner_config
        if config.apply_router_weight_on_input or config.activation != "silu" or config.gemm1_alpha is not None:
            raise NotImplementedError("qurl MoE experts support SiLU-gated experts with output-side routing weights")
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = experts_forward(x, topk_weights, topk_ids, layer.qurl_w13_weight, layer.qurl_w2_weight, self.spec)
        return StandardCombineInput(hidden_states=out)
