"""SGLang FusedMoE method: each expert's gate/up (w13) and down (w2) projections run `qurl_mcore.quant`'s
quantized linear numerics, with one `quantize_weight` per expert matrix (the trainer quantizes per-expert
weights), all experts at once."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from qurl_mcore.quant import QTensor, QuantLinearSpec, quantize_activation, quantize_weight

from . import kernels, weights
from .options import QurlOptions

_WEIGHTS = ("w13_weight", "w2_weight")
#: fp32 elements of one token chunk's [experts, tokens, features] activations (256 MiB)
_CHUNK_ELEMENTS = 1 << 26


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: QTensor,
                    w2: QTensor, spec: QuantLinearSpec) -> torch.Tensor:
    """out[t] = Σ_j p[t, j] · Q̃(silu(g) ⊙ u)·Q(W2_e)ᵀ with [g; u] = Q̃(X_e)·Q(W13_e)ᵀ and e = topk_ids[t, j]
    (gate rows first in W13, as in the checkpoint's gate_proj/up_proj and Megatron's fc1), for stacked
    experts w13 [E, 2I, H] and w2 [E, H, I] (`weights.stack`). X_e holds the tokens routed to e, as the
    trainer's expert e receives them: its per-tensor scale (NVFP4) is theirs. Tokens routed to ids outside
    [0, E) (padding, other EP ranks) contribute nothing; the weighted sum is taken in fp32.

    All experts run at once on [E, tokens, H] with the unrouted rows zero (a zero row quantizes to zero and
    leaves every scale as it was): a few batched GEMMs with static shapes and no read-back to the host, so
    CUDA graphs capture it and torch.compile traces it whole, at E/k times the routed FLOPs (the emulated
    formats' price for that). Tokens go in chunks that bound the activations' memory (_CHUNK_ELEMENTS); an
    NVFP4 scale then covers an expert's tokens of one chunk, as SGLang's chunked prefill already splits the
    batch. Layer outputs are rounded to x's dtype as the trainer's quantized linears round theirs."""
    experts = w13.shape[0]
    slots = (topk_ids >= 0) & (topk_ids < experts)
    index = torch.where(slots, topk_ids, 0).long()
    zeros = torch.zeros(x.shape[0], experts, dtype=torch.float32, device=x.device)
    routing = zeros.scatter_add(1, index, torch.where(slots, topk_weights.float(), 0.0))  # [T, E]
    routed = zeros.scatter_add(1, index, slots.float()) > 0
    w13_f, w2_f = w13.dequantize(torch.float32).transpose(1, 2), w2.dequantize(torch.float32).transpose(1, 2)
    chunk = max(1, _CHUNK_ELEMENTS // (experts * max(w13.shape[1], w13.shape[2])))
    out = []
    for xs, ps, rs in zip(x.split(chunk), routing.split(chunk), routed.split(chunk)):
        x_e = torch.where(rs.t()[:, :, None], xs, 0)  # [E, T, H]
        h = torch.bmm(quantize_activation(x_e, spec, batch_dims=1), w13_f).to(x.dtype)
        gate, up = h.chunk(2, dim=-1)
        hidden = F.silu(gate) * up  # unrouted rows stay zero: silu(0) * 0
        y = torch.bmm(quantize_activation(hidden, spec, batch_dims=1), w2_f).to(x.dtype)  # [E, T, H]
        out.append(torch.einsum("eth,te->th", y.float(), ps))
    return torch.cat(out).to(x.dtype)


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
        for name in _WEIGHTS:
            w = getattr(layer, name).data
            fresh = [quantize_weight(weights.at_home(layer, name, w[e]), self.spec) for e in range(w.shape[0])]
            old = getattr(layer, f"qurl_{name}_experts", None)
            kept = None if old is None else [weights.store(o, f) for o, f in zip(old, fresh)]
            if kept is None or any(k is not o for k, o in zip(kept, old)):  # first load: one stacked copy
                stacked, kept = weights.stack(fresh)
                setattr(layer, f"qurl_{name}", stacked)
            setattr(layer, f"qurl_{name}_experts", kept)  # views of the stack, refreshed in place
            weights.detach_master(layer, name, host=self.options.master == "host")

    def restore_weights_before_loading(self, layer) -> None:
        for name in _WEIGHTS:
            weights.attach_master(layer, name)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        if self._use_kernels(x.device):
            w13, w2 = layer.qurl_w13_weight, layer.qurl_w2_weight
            return self.runner.run(dispatch_output, kernels.moe_quant_info(self.options.fmt, w13.data, w13.scale,
                                                                           w2.data, w2.scale))
        config = self.moe_runner_config
        if config.apply_router_weight_on_input or config.activation != "silu" or config.gemm1_alpha is not None:
            raise NotImplementedError("qurl MoE experts support SiLU-gated experts with output-side routing weights")
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = experts_forward(x, topk_weights, topk_ids, layer.qurl_w13_weight, layer.qurl_w2_weight, self.spec)
        return StandardCombineInput(hidden_states=out)
