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
from qurl_mcore.quant import quantize_weight
from qurl_mcore.quant.experts import experts_forward
from qurl_mcore.quant.qtensor import no_host_reads
from qurl_mcore.quant.wire import COLUMNS, ROWS, has_global_scale, shard

from . import kernels, weights
from .options import REQUANTS, QurlOptions

_WEIGHTS = ("w13_weight", "w2_weight")
#: the layer's experts whose pieces wait for the rest of their matrix (NVFP4's w13)
_WAITING = "_qurl_waiting"


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


def piece_rows(shard_id: str, rows: int) -> slice:
    """The rows of a rank's shard of an expert matrix (`rows` of them) that SGLang's loader fills from the
    checkpoint piece `shard_id`: gate (w1) the first half of w13, up (w3) the second, down (w2) all of w2."""
    half = rows // 2
    return {"w1": slice(0, half), "w3": slice(half, rows), "w2": slice(0, rows)}[shard_id]


#: the checkpoint pieces (SGLang's shard ids) that make up each expert matrix
_PIECES = {"w13_weight": {"w1", "w3"}, "w2_weight": {"w2"}}


class QurlFusedMoEMethod(FusedMoEMethodBase):
    """MoE experts with BF16 weights in and quantized experts out, quantized as they load (module docstring of
    weights.py for the refit cycle).

    The layer's stacked codes and scales exist from `create_weights` on; its full-precision experts never do on
    the device (but with master="device"). Each checkpoint piece of an expert (gate, up, down), as SGLang's
    loader shards it, lands in the expert's rows of the master (push "bf16": pinned host memory by default) or,
    without masters (push "codes"), in a buffer of one expert on the device, and is quantized at once into the
    stack with `quantize_weight`, one rank's shard of one expert matrix at a time as the trainer quantizes it.
    Formats whose scales lie within a row (INT8/FP8 per channel, MXFP4 blocks) quantize a gate or up piece
    alone: bitwise its rows of the whole matrix's quantization. NVFP4's global scale spans the expert's w13, so
    its gate waits for its up (or, in a push that carried one of them, for the end of the push: the other's
    rows are then the master's). A bf16 push goes through the same loader, so it re-quantizes exactly the
    experts it carried."""

    def __init__(self, options: QurlOptions):
        super().__init__()
        self.options = options
        self.spec = options.recipe.spec
        self.quantize_weight = REQUANTS[options.requant]
        self.rows_apart = not has_global_scale(self.spec)  # then a piece quantizes alone
        self.runner = None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       with_bias: bool = False, **extra_weight_attrs):
        if with_bias:
            raise NotImplementedError("qurl quantization does not support MoE expert biases")
        if not layer.moe_runner_config.is_gated:
            raise NotImplementedError("qurl quantization supports gated (gate/up) MoE experts only")
        inter = intermediate_size_per_partition
        home = torch.get_default_device()  # SGLang builds the model on its device
        layer.__dict__[_WAITING] = {name: {} for name in _WEIGHTS}
        for name, shape in {"w13_weight": (2 * inter, hidden_size), "w2_weight": (hidden_size, inter)}.items():
            with no_host_reads():  # the layout of one expert's codes: nothing is computed on the meta device
                # (eager: the compiled quantizer gives the same layout, and inductor compiles for no meta device)
                layout = quantize_weight(torch.empty(shape, dtype=params_dtype, device="meta"), self.spec)
            stacked, views = weights.empty_stack(num_experts, layout, home)
            setattr(layer, f"qurl_{name}", stacked)
            setattr(layer, f"qurl_{name}_experts", views)  # views of the stack, written in place
            weights.set_home(layer, name, home)
            if self.options.codes:  # no master: a stand-in of the right shape (the loader writes a buffer of one)
                rows = torch.empty((1, 1, 1), dtype=params_dtype).expand(num_experts, *shape)
            else:
                host = self.options.master == "host" and home.type != "cpu"
                rows = torch.empty((num_experts, *shape), dtype=params_dtype, device="cpu" if host else home,
                                   pin_memory=host)
            param = torch.nn.Parameter(rows, requires_grad=False)
            set_weight_attrs(param, {**extra_weight_attrs,
                                     "weight_loader": self._loader(layer, name, extra_weight_attrs["weight_loader"])})
            layer.register_parameter(name, param)

    def _loader(self, layer, name: str, sglang_loader):
        """The weight loader of `name`: SGLang's (`sglang_loader`) writes a piece into an expert's rows, which
        are quantized as soon as they can be (class docstring)."""
        waiting = layer.__dict__[_WAITING][name]  # expert -> (the pieces that arrived, its rows)

        def load(param, loaded: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> None:
            expert = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if expert == -1:
                return  # another EP rank's, as SGLang's loader skips it
            arrived, rows = waiting.pop(expert, (set(), None))
            if rows is None:
                rows = (torch.empty(param.shape[1:], dtype=param.dtype, device=weights.home(layer, name))
                        if self.options.codes else param.data[expert])
            # SGLang's loader shards the piece into `rows` (its param.data[expert]; every expert's is `rows`)
            sglang_loader(rows.unsqueeze(0).expand(param.shape), loaded, weight_name, shard_id, expert_id)
            arrived.add(shard_id)
            if self.rows_apart:
                self._quantize(layer, name, expert, rows, piece_rows(shard_id, rows.shape[0]))
            elif arrived == _PIECES[name]:
                self._quantize(layer, name, expert, rows, slice(None))
            else:
                waiting[expert] = arrived, rows  # NVFP4: the other half of w13 brings the global scale

        return load

    def _quantize(self, layer, name: str, expert: int, rows: torch.Tensor, part: slice) -> None:
        """Rows `part` of the expert's full-precision `rows`, quantized into its codes and scales in place."""
        q = self.quantize_weight(weights.at_home(layer, name, rows[part]), self.spec)
        weights.store_rows(getattr(layer, f"qurl_{name}_experts")[expert], q, part)

    def process_weights_after_loading(self, layer) -> None:
        if weights.detach_codes(layer) or not all(weights.is_loaded(layer, n) for n in _WEIGHTS):
            return  # a code push installed its codes, or nothing was restored since the last load
        for name in _WEIGHTS:
            for expert, (arrived, rows) in layer.__dict__[_WAITING][name].items():
                if self.options.codes:
                    raise ValueError(f"{layer.layer_name}: expert {expert} of this rank got only "
                                     f"{sorted(arrived)} of {sorted(_PIECES[name])}; the checkpoint lacks "
                                     f"{sorted(_PIECES[name] - arrived)}: load a complete checkpoint")
                self._quantize(layer, name, expert, rows, slice(None))  # a push of one: the master has the other
            layer.__dict__[_WAITING][name].clear()
            if self.options.codes:
                weights.release(layer, name)
            else:
                weights.detach_master(layer, name, host=self.options.master == "host")

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        # The Triton runner serves the GPU kernel path; like SGLang's unquantized method we also create it on
        # CPU, where it only declares the standard top-k contract (apply() then never calls it).
        self.runner = MoeRunner(MoeRunnerBackend.TRITON, moe_runner_config)

    def _use_kernels(self, device: torch.device) -> bool:
        return self.options.kernel == "auto" and kernels.available(self.options.recipe.format, device)

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
