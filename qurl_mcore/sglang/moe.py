"""SGLang FusedMoE method: each expert's gate/up (w13) and down (w2) projections run `qurl_mcore.quant`'s
quantized linear numerics (`quant.experts.experts_forward`, all experts at once), with one `quantize_weight`
per expert matrix (the trainer quantizes per-expert weights). On CUDA (`kernel: auto`) INT8/FP8 experts take
SGLang's W8A8 Triton runner and FP4 experts the fused FP4 kernels (`qurl_mcore.kernels`: routed experts only,
packed weights), the same function up to the order of fp32 sums."""
from __future__ import annotations

import torch
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from qurl_mcore import kernels as fp4_kernels
from qurl_mcore.kernels.fp4_moe import fp4_experts
from qurl_mcore.quant.experts import experts_forward
from qurl_mcore.quant.wire import COLUMNS, ROWS, shard

from . import kernels, weights
from .options import REQUANTS, QurlOptions

_WEIGHTS = ("w13_weight", "w2_weight")


def expert_rows_loader(layer, name: str):
    """A weight loader for one of a code push's stacked expert tensors (`name`: w13_weight or w2_weight, or its
    scales), sharded as SGLang's FusedMoE shards the full-precision experts (`_load_w13`, `_load_w2`): an
    expert's gate rows (shard w1) fill the first half of its w13 rows, its up rows (w3) the second, each this
    rank's rows of the expert's (expert-TP) shard; its down codes and scales (w2) this rank's columns; a global
    scale ([E]) takes this rank's value of the expert's ([shards], `quant.wire`). Experts of other EP ranks are
    skipped, as SGLang's loader skips them."""
    split = ROWS if name == "w13_weight" else COLUMNS

    def load(param, loaded: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> None:
        expert = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if expert == -1:
            return
        rows = param.data[expert]
        if not rows.dim():  # the expert's global scale
            rows.copy_(loaded.reshape(-1)[layer.moe_tp_rank])
            return
        if name == "w13_weight":
            half = rows.shape[0] // 2
            rows = rows[:half] if shard_id == "w1" else rows[half:]
        rows.copy_(shard(loaded, split, layer.moe_tp_rank, layer.moe_tp_size))

    return load


class QurlFusedMoEMethod(FusedMoEMethodBase):
    """MoE experts with BF16 weights in and quantized experts out; refits like the linear method (weights.py)."""

    def __init__(self, options: QurlOptions):
        super().__init__()
        self.options = options
        self.spec = options.recipe.spec
        self.quantize_weight = REQUANTS[options.requant]
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
        return self.options.kernel == "auto" and kernels.available(self.options.recipe.format, device)

    def process_weights_after_loading(self, layer) -> None:
        if weights.detach_codes(layer) or not all(weights.is_loaded(layer, n) for n in _WEIGHTS):
            return
        for name in _WEIGHTS:
            w = getattr(layer, name).data
            fresh = [self.quantize_weight(weights.at_home(layer, name, w[e]), self.spec) for e in range(w.shape[0])]
            old = getattr(layer, f"qurl_{name}_experts", None)
            kept = None if old is None else [weights.store(o, f) for o, f in zip(old, fresh)]
            if kept is None or any(k is not o for k, o in zip(kept, old)):  # first load: one stacked copy
                stacked, kept = weights.stack(fresh)
                setattr(layer, f"qurl_{name}", stacked)
            setattr(layer, f"qurl_{name}_experts", kept)  # views of the stack, refreshed in place
            if self.options.codes:
                weights.release(layer, name)
            else:
                weights.detach_master(layer, name, host=self.options.master == "host")

    def restore_weights_before_loading(self, layer) -> None:
        for name in _WEIGHTS:
            if self.options.codes:
                load = expert_rows_loader(layer, name)
                weights.attach_codes(layer, name, getattr(layer, f"qurl_{name}"), load, load)
            else:
                weights.attach_master(layer, name)

    def apply(self, layer, dispatch_output):
        x = dispatch_output.hidden_states
        if self._use_kernels(x.device):
            w13, w2 = layer.qurl_w13_weight, layer.qurl_w2_weight
            info = kernels.moe_quant_info(self.options.recipe.format, w13.data, w13.scale, w2.data, w2.scale)
            return self.runner.run(dispatch_output, info)
        config = self.moe_runner_config
        if config.apply_router_weight_on_input or config.activation != "silu" or config.gemm1_alpha is not None:
            raise NotImplementedError("qurl MoE experts support SiLU-gated experts with output-side routing weights")
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        fp4 = self.options.kernel == "auto" and fp4_kernels.serves(self.spec, x.device)
        experts = fp4_experts if fp4 else experts_forward
        out = experts(x, topk_weights, topk_ids, layer.qurl_w13_weight, layer.qurl_w2_weight, self.spec)
        return StandardCombineInput(hidden_states=out)
