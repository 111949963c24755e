"""What the tests of tests/gpu_trace run in a traced process (`qurl_mcore.fakecuda.run_traced`): module-level
functions with picklable arguments and results."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from qurl_mcore.fakecuda import NcclDeviceError, NcclError, fake_cuda


def collectives() -> dict:
    """Which tensors the NCCL-like default group and a gloo group take, and what a device mix does."""
    out = {}
    with fake_cuda(devices=8, world_size=8, rank=3, device=3) as trace:
        x = torch.empty(1024, device="cuda")
        dist.all_reduce(x)
        out["device"] = str(x.device)
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.float64))
        except NcclDeviceError as err:
            out["nccl_cpu"] = str(err)
        dist.all_reduce(torch.ones(3), group=dist.new_group([0, 1, 2, 3], backend="gloo"))
        try:
            x[:3] + torch.ones(3)
        except RuntimeError as err:
            out["mix"] = type(err).__name__
        y = x[2:].to(torch.bfloat16).cuda()
        out["live"], out["peak"] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        del x
        out["live_after_del"] = torch.cuda.memory_allocated()
        out["peak_after_del"] = trace.peak_bytes
        out["y"] = (str(y.device), str(y.dtype))
        out["capability"] = torch.cuda.get_device_capability()
    return out


def nccl_rules() -> dict[str, str | None]:
    """Each collective of `NCCL_CASES` on the NCCL-like default group of 4 ranks, as rank 2 on cuda:2: the
    NcclError it raised, or None."""
    out = {}
    with fake_cuda(devices=4, world_size=4, rank=2, device=2):
        for case, collective in NCCL_CASES.items():
            try:
                collective()
                out[case] = None
            except NcclError as err:
                out[case] = f"{type(err).__name__}: {err}"
    return out


def _t(*shape, dtype=torch.float32, device="cuda:2"):
    return torch.empty(*shape, dtype=dtype, device=device)


#: collectives, each breaking at most one of NCCL's rules (the ones named ok_* break none)
NCCL_CASES = {
    "ok_own_device": lambda: dist.all_reduce(_t(4)),
    "other_device": lambda: dist.all_reduce(_t(4, device="cuda:1")),
    "int16": lambda: dist.broadcast(_t(4, dtype=torch.int16), src=0),
    "ok_fp8_broadcast": lambda: dist.broadcast(_t(4, dtype=torch.float8_e4m3fn), src=0),
    "fp8_all_reduce": lambda: dist.all_reduce(_t(4, dtype=torch.float8_e4m3fn)),
    "ok_bool_max": lambda: dist.all_reduce(_t(4, dtype=torch.bool), op=dist.ReduceOp.MAX),
    "bool_avg": lambda: dist.all_reduce(_t(4, dtype=torch.bool), op=dist.ReduceOp.AVG),
    "int_band": lambda: dist.all_reduce(_t(4, dtype=torch.int32), op=dist.ReduceOp.BAND),
    "ok_all_gather": lambda: dist.all_gather_into_tensor(_t(4, 3), _t(1, 3)),
    "all_gather_size": lambda: dist.all_gather_into_tensor(_t(3, 3), _t(1, 3)),
    "all_gather_dtype": lambda: dist.all_gather_into_tensor(_t(4, 3, dtype=torch.bfloat16), _t(1, 3)),
    "ok_reduce_scatter": lambda: dist.reduce_scatter_tensor(_t(2), _t(8)),
    "reduce_scatter_size": lambda: dist.reduce_scatter_tensor(_t(2), _t(6)),
    "ok_all_to_all": lambda: dist.all_to_all_single(_t(6, 2), _t(5, 2), [3, 1, 1, 1], [2, 1, 1, 1]),
    "all_to_all_splits": lambda: dist.all_to_all_single(_t(6, 2), _t(5, 2), [3, 1, 1, 1], [2, 1, 1, 2]),
    "all_to_all_even": lambda: dist.all_to_all_single(_t(6, 2), _t(6, 2)),
}


def collectives_of(rank: int, rows: list[int], sends: list[list[int]]) -> list:
    """The collectives (`Trace.collectives`) rank `rank` of 2 issues: an all-reduce of `rows[rank]` rows, then
    an all-to-all sending `sends[rank][peer]` rows to each peer and receiving `sends[peer][rank]`."""
    with fake_cuda(devices=2, world_size=2, rank=rank, device=rank) as trace:
        dist.all_reduce(torch.empty(rows[rank], 8, device="cuda"))
        receives = [sends[peer][rank] for peer in range(2)]
        dist.all_to_all_single(torch.empty(sum(receives), 8, device="cuda"),
                               torch.empty(sum(sends[rank]), 8, device="cuda"), receives, sends[rank])
    return trace.collectives


def ranks_collectives(cases: list[tuple]) -> list[list[str]]:
    """For each case (rows, sends, receives_of_1): `mismatched_collectives` of ranks 0 and 1 of
    `collectives_of(rank, rows, sends)`, each traced in turn in this process; with `receives_of_1`, rank 1's
    all-to-all expects that many rows from each peer instead."""
    from qurl_mcore.fakecuda import mismatched_collectives

    out = []
    for rows, sends, receives_of_1 in cases:
        logs = {rank: collectives_of(rank, rows, sends) for rank in range(2)}
        if receives_of_1 is not None:
            logs[1][-1] = dataclasses.replace(logs[1][-1], receives=tuple(receives_of_1))
        out.append(mismatched_collectives(logs))
    return out


def model_parallel(tp: int, world_size: int, rank: int) -> dict:
    """Megatron's groups on the fake group: this rank's place in them."""
    from megatron.core import parallel_state as ps

    from qurl_mcore.megatron import init_parallel

    with fake_cuda(devices=8, world_size=world_size, rank=rank, device=rank % 8):
        init_parallel(tp, 1, rank=rank, world_size=world_size)
        return dict(tp=ps.get_tensor_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
                    tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def trainer_steps(arch: str, overrides: list[str], rows: list[int], tp: int = 2, world_size: int = 8,
                  rank: int = 1, push: bool = False) -> dict:
    """A PolicyTrainer rank (bf16, Megatron's DDP with overlap_grad_reduce, the configured optimizer) built
    from tiny `arch` and stepped once per entry of `rows` (rows of the whole batch; this rank keeps its
    DP share), traced as rank `rank` of `world_size`. Returns the parameters' (device, dtype) kinds of the
    policy and reference, and the peak CUDA bytes after the build and after each step; with `push`, then a
    push's export broadcast over the NCCL-like default group as a disaggregated push sends it, and the
    (HF name, device, dtype) of each tensor the export gave; and the host synchronizations by site."""
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer
    from qurl_mcore.models.tiny import tiny_checkpoint
    from tests.loop.workers import batch

    path = tiny_checkpoint(arch, tokenizer=False)
    cfg = load_config(None, [f"model.path={path}", "precision=bf16", "uaq.enabled=false", "train.loss=ppo",
                             "train.lr=1e-3", f"train.tp_size={tp}", "train.micro_batch_size=2", *overrides])
    out = {}
    with fake_cuda(devices=8, world_size=world_size, rank=rank, device=rank % 8) as trace:
        trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)
        out["policy"] = sorted({(str(p.device), str(p.dtype)) for p in trainer.model.parameters()})
        if trainer.ref is not None:
            out["reference"] = sorted({(str(p.device), str(p.dtype)) for p in trainer.ref.parameters()})
        out["peaks"] = [trace.peak_bytes]
        for n in rows:
            trainer.step(batch(rows=n, moe=trainer.moe))
            out["peaks"].append(trace.peak_bytes)
        if push:
            from qurl_mcore.rollout.broadcast import WeightSender

            sender = WeightSender(None, "qurl-trace", "nccl", world_size)
            out["pushed"] = []
            with trainer.weight_stream(smoothed=True) as stream:
                for bucket in stream:
                    out["pushed"] += [(name, str(t.device), str(t.dtype)) for name, t in bucket]
                    sender.send(bucket)
        trainer.close()
        out["host_sync_sites"] = dict(trace.sync_sites)
    return out


def scaled_mm_out_dtype(gpu: str) -> tuple[str, str]:
    """The out_dtype `quantized_matmul` asks torch._scaled_mm for with fp8 row-wise operands on `gpu`, and the
    dtype it returns (fp32 asked)."""
    from torch.overrides import TorchFunctionMode

    from qurl_mcore.quant.qtensor import quantize
    from qurl_mcore.quant.gemm import quantized_matmul

    asked = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch._scaled_mm:
                asked.append(str(kwargs.get("out_dtype")))
            return func(*args, **(kwargs or {}))

    with fake_cuda(gpu=gpu):
        a = quantize(torch.randn(32, 64, device="cuda"), "fp8_e4m3", "token")
        b = quantize(torch.randn(48, 64, device="cuda"), "fp8_e4m3", "channel")
        with Record():
            out = quantized_matmul(a, b, backend="fp8", out_dtype=torch.float32)
    return asked[0], str(out.dtype)


def engine_pushes(masters: list[str]) -> dict[str, dict]:
    """`engine_push` for each `master` option, in this one process (SGLang imports once)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: the qurl plugin registers its hooks, SGLang applies them
    return {master: engine_push(master) for master in masters}


def engine_push(master: str) -> dict:
    """R3: a qurl_int8 engine's linears on a fake GPU through SGLang 0.5.23's own loader code: the load's
    quantization (`postprocess_weights`), then a push as `begin_weight_update`, the loaders' writes and
    `end_weight_update` run it, each layer inside SGLang's `device_loading_context`. Returns the masters'
    devices during and after the push, the masters' bytes, and the CUDA bytes above what the load left: after
    the push's begin, at the push's peak and after its end."""
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from qurl_mcore.sglang.options import QurlOptions
    from qurl_mcore.sglang.quant_config import CONFIGS

    config = CONFIGS["qurl_int8"](QurlOptions.parse("qurl_int8", {"master": master}))
    shapes = {"model.layers.0.self_attn.o_proj": (512, 256), "model.layers.0.mlp.down_proj": (512, 1024),
              "model.layers.1.self_attn.o_proj": (512, 256), "model.layers.1.mlp.down_proj": (512, 1024)}
    with fake_cuda() as trace:
        cuda = torch.device("cuda", 0)
        with torch.device(cuda):  # SGLang builds the model on its device
            layers = {name: ReplicatedLinear(k, n, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                                             prefix=name) for name, (n, k) in shapes.items()}
        model = torch.nn.ModuleList(layers.values())
        for layer in layers.values():  # the checkpoint's BF16 weights
            layer.weight.weight_loader(layer.weight, torch.empty_like(layer.weight))
        DefaultModelLoader.postprocess_weights(model, cuda)  # the load's quantization

        def masters() -> list[str]:  # the devices of the masters, on the layer (in a push) or waiting apart
            return sorted({str(layer.weight.device) if "weight" in layer._parameters
                           else str(layer._qurl_masters["weight"].device) for layer in layers.values()})

        def live() -> int:  # CUDA bytes alive now
            trace.reset_peak()
            return trace.live_bytes

        out = {"loaded": masters()}
        base = live()
        DefaultModelLoader.restore_weights_before_loading(model, cuda)  # begin_weight_update
        out["during"] = masters()
        out["restore_bytes"] = live() - base
        for layer in layers.values():  # update_weights_from_*: SGLang's loaders write the pushed BF16 tensors
            pushed = torch.empty(layer.weight.shape, dtype=torch.bfloat16, device=cuda)
            layer.weight.weight_loader(layer.weight, pushed)
            del pushed
        DefaultModelLoader.postprocess_weights(model, cuda)  # end_weight_update
        out["after"] = masters()
        out["push_peak_bytes"] = trace.peak_bytes - base
        out["after_bytes"] = live() - base
        out["master_bytes"] = sum(2 * n * k for n, k in shapes.values())
    return out


def platforms(gpus: list[str]) -> dict[str, dict]:
    """What torch and SGLang's platform probes answer inside `fake_cuda(gpu=gpu)` for each of `gpus` in turn
    (SGLang imported inside the first context, as a traced engine imports it), and after each."""
    return {gpu: _platform(gpu) for gpu in gpus}


def _platform(gpu: str) -> dict:
    with fake_cuda(gpu=gpu):
        from sglang.srt.utils import common

        inside = dict(cuda=torch.version.cuda, capability=torch.cuda.get_device_capability(),
                      major=torch.cuda.get_device_properties(0).major, is_cuda=common.is_cuda(),
                      sm=common.get_device_sm(), sm90=common.is_sm90_supported(), sm100=common.is_sm100_supported(),
                      hopper=common.is_hopper_with_cuda_12_3(), blackwell=common.is_blackwell())
    return dict(inside=inside, after=dict(cuda=torch.version.cuda, is_cuda=common.is_cuda()))


def host_reads() -> dict:
    """Data-dependent reads of fake CUDA tensors: what each answers, and the host synchronizations counted."""
    out = {}
    with fake_cuda() as trace:
        x = torch.empty(8, device="cuda")
        out["item"] = x.sum().item()  # 1: unknown, reads 1
        out["finite"] = torch.isfinite(x).all().item()  # 2
        x.cpu()  # 3
        x.to("cpu", non_blocking=True)  # not a sync: the synchronize that waits for it is
        torch.cuda.synchronize()  # 4
        out["selected"] = x[x > 0].shape[0]  # 5: a mask selects everything
        logits = torch.empty(12, 8, device="cuda")  # 12 tokens, 8 experts, top-2
        routing = torch.zeros_like(logits).int().scatter(1, logits.topk(2, dim=1).indices, 1).bool()
        per_expert = routing.sum(dim=0).cpu()  # 6: a real host tensor
        out["per_expert"] = per_expert.tolist()  # host data: no sync
        out["per_token"] = routing.sum(dim=1).tolist()  # 7
        out["routed"] = routing.sum().item()  # 8
        out["masked_select"] = logits.masked_select(routing).shape[0]  # 9
        out["nonzero"] = tuple(routing.nonzero().shape)  # 10
        out["zeros_any"] = bool(torch.zeros(3, device="cuda").any())  # 11
        out["host_is_real"] = not isinstance(per_expert * 2, torch._subclasses.fake_tensor.FakeTensor)
        out["host_syncs"] = trace.host_syncs
        out["sites"] = dict(trace.sync_sites)
    return out


def uaq_per_head_on_device() -> tuple[str, str]:
    """UAQ's per-head scaling of MLA's kv_b_proj (2 heads of 3 k rows and 2 v rows) on a fake GPU: the
    output's device and dtype."""
    from qurl_mcore.uaq import scale_per_head

    with fake_cuda():
        out = scale_per_head(torch.empty(10, 4, dtype=torch.bfloat16, device="cuda"), "kv_b", (3, 2), 2.0)
        return str(out.device), str(out.dtype)


def shared_expert_fusion(gpu: str, checkpoints: dict[str, tuple[str, dict]]) -> dict[str, dict[str, tuple[bool, int]]]:
    """SGLang's own shared-expert fusion decision (`resolve_shared_experts_config`, which the loader asks before
    building a model) on a fake `gpu`, per model (its class; its tiny checkpoint and config overrides, the full
    model's where the decision reads them) and engine: a BF16 engine and a `qurl_fp4_rc` one, each with the server
    arguments `EngineConfig` gives it. (fusion disabled, experts fused)."""
    with fake_cuda(gpu=gpu):
        from sglang.srt.layers.moe.utils import resolve_shared_experts_config
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
        from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
        from sglang.srt.runtime_context import create_context, use_context
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig

        from qurl_mcore.rollout import EngineConfig
        from qurl_mcore.sglang import register
        from qurl_mcore.sglang.quant_config import CONFIGS

        register()
        classes = {"glm4_moe": Glm4MoeForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}
        out = {}
        for model, (path, overrides) in checkpoints.items():
            hf = AutoConfig.from_pretrained(path)
            for key, value in overrides.items():
                setattr(hf, key, value)
            out[model] = {}
            for name, method in (("bf16", None), ("qurl_fp4_rc", "qurl_fp4_rc")):
                engine = EngineConfig(path, method, device="cpu") if method else EngineConfig(path, device="cpu")
                with use_context(create_context(ServerArgs(**engine.engine_kwargs()), role="scheduler")):
                    layout = resolve_shared_experts_config(classes[model], hf, CONFIGS[method]() if method else None)
                out[model][name] = (layout.fusion_disabled, layout.num_fused_shared_experts)
    return out


def mla_decode_weights(gpu: str) -> dict:
    """Defect 7 on a fake `gpu`: SGLang's own DeepseekV3ForCausalLM (the tiny checkpoint, TP 1) built with a
    `qurl_int8` engine of scope "all" and loaded by SGLang's loader (`plantrace.load_sglang_model`, as `qurl
    plan --trace` builds an engine), then pushed once as SGLang's loader runs a push (the plugin's
    restore, the model's `load_weights`, which rebuilds MLA's decode weights `w_kc`/`w_vc` from kv_b_proj, and
    the re-quantization), every tensor in bf16 as the trainer's export sends it. Returns,
    per layer and after the load and after the push, the kv_b_proj's linear method, the dtypes and shapes of its
    weight and of `w_kc`, `w_vc`, the linear methods of q_b_proj, kv_b_proj and o_proj, and the HF module names the
    engine reported as quantized (what the symmetry check compares)."""
    import os
    import tempfile

    from safetensors import safe_open

    from qurl_mcore.models.tiny import tiny_checkpoint

    path = str(tiny_checkpoint("deepseek_v3"))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    fd, log = tempfile.mkstemp(suffix=".txt")
    os.close(fd)
    os.environ["QURL_QUANTIZED_LOG"] = log
    options = {"scope": "all"}
    with fake_cuda(gpu=gpu):
        from sglang.srt.utils import common

        from qurl_mcore.plantrace import load_sglang_model, push_sglang_model, sglang_parallel
        from qurl_mcore.rollout import EngineConfig

        engine = EngineConfig(path, "qurl_int8", options, device="cpu", dtype="bfloat16")
        cuda = torch.device("cuda", 0)
        out = {"is_cuda": common.is_cuda(), "sm": common.get_device_sm()}

        def weights():  # the checkpoint's, or the trainer's export, in bf16
            return ((name, torch.empty(shape, dtype=torch.bfloat16, device=cuda)) for name, shape in shapes.items())

        def seen():
            layers = {}
            for i, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                layers[i] = {"kv_b": (str(attn.kv_b_proj.weight.dtype), tuple(attn.kv_b_proj.weight.shape)),
                             "w_kc": (str(attn.w_kc.dtype), tuple(attn.w_kc.shape), str(attn.w_kc.device)),
                             "w_vc": (str(attn.w_vc.dtype), tuple(attn.w_vc.shape), str(attn.w_vc.device)),
                             "methods": {n: type(getattr(attn, n).quant_method).__name__
                                         for n in ("q_b_proj", "kv_b_proj", "o_proj")},
                             "dims": (attn.num_local_heads, attn.qk_nope_head_dim, attn.v_head_dim,
                                      attn.kv_lora_rank)}
            return layers

        with sglang_parallel(engine.engine_kwargs(), 1) as args:
            model = load_sglang_model(args, weights)  # SGLang's loader: the checkpoint, then the quantization
            out["class"] = type(model).__name__
            out["loaded"] = seen()
            push_sglang_model(model, weights())
            out["pushed"] = seen()
    out["reported"] = sorted(set(open(log).read().split()))
    os.unlink(log)
    return out


def checkpointed_attention_peaks(lengths: list[int], heads: int = 32, head_dim: int = 128) -> list[int]:
    """The CUDA bytes a masked `scaled_dot_product_attention` adds at its peak over forward and backward, run as
    Megatron's full recompute runs a layer (a reentrant checkpoint: the backward, on autograd's device thread,
    runs the forward again), for sequences of each of `lengths` tokens."""
    import torch.utils.checkpoint as checkpoint

    peaks = []
    for s in lengths:
        with fake_cuda() as trace:
            q, k, v = (torch.empty(1, heads, s, head_dim, device="cuda", requires_grad=True) for _ in range(3))
            mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()[None, None]
            base = trace.live_bytes
            trace.reset_peak()
            attention = lambda *qkv: torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=mask)  # noqa: E731
            checkpoint.checkpoint(attention, q, k, v, use_reentrant=True).sum().backward()
            peaks.append(trace.peak_bytes - base)
    return peaks


@dataclasses.dataclass
class _Codes:
    data: torch.Tensor
    scale: torch.Tensor


def module_storages() -> tuple[int, int]:
    """`plantrace._storages` of a module holding CUDA storages as a parameter (fp32 [4, 8]: 128 bytes), a buffer
    (64), a dataclass attribute (int8 codes 32 and fp32 scales 16, as the plugin keeps its codes), views of the
    parameter in a list (nothing new) and a host tensor (not CUDA); and the façade's CUDA bytes alive."""
    from qurl_mcore.plantrace import _storages

    with fake_cuda():
        m = torch.nn.Linear(8, 4, bias=False, device="cuda")
        m.register_buffer("cache", torch.empty(16, device="cuda"))
        m.codes = _Codes(torch.empty(32, dtype=torch.int8, device="cuda"), torch.empty(4, device="cuda"))
        m.views = [m.weight[0], m.weight[1:]]
        m.host = torch.empty(100)
        return sum(_storages(torch.nn.Sequential(m)).values()), torch.cuda.memory_allocated()


def host_master(numel: int) -> dict:
    """The plugin's `detach_master` (master="host") of a bf16 parameter of `numel` elements on a fake GPU: the
    master's type, the CUDA bytes left, how far the process's peak resident memory grew over the copy (KiB); and
    what a read of a host copy of CUDA zeros answers."""
    import resource

    from qurl_mcore.sglang.weights import _MASTERS, detach_master

    with fake_cuda() as trace:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16, device="cuda"),
                                          requires_grad=False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        detach_master(layer, "weight", host=True)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        master = layer.__dict__[_MASTERS]["weight"]
        out = dict(fake=isinstance(master, torch._subclasses.fake_tensor.FakeTensor), device=str(master.device),
                   cuda_bytes=torch.cuda.memory_allocated(), rss_growth_kib=grown, host_syncs=trace.host_syncs)
        out["zeros_any"] = bool(torch.empty(4, device="cpu").copy_(torch.zeros(4, device="cuda")).any())
        return out


def moe_loads(cases: list[tuple[str, dict]], experts: int = 64) -> dict[str, dict[str, int]]:
    """For each (method, options) case: one decoder layer of a Qwen3-MoE with `experts` experts (and a small
    vocabulary) under the plugin's `method` and `options`, built and loaded on a fake GPU by SGLang's
    `DefaultModelLoader` as an engine loads it, the checkpoint's bf16 tensors fed one at a time without values.
    Returns per case the CUDA bytes at the load's peak and after it, the experts' bytes in bf16 and as the
    plugin's codes, an expert's w13 (gate and up) in bf16, and the other weights' bytes in bf16."""
    import json
    import math
    import tempfile
    from pathlib import Path

    from sglang.srt.server_args import ServerArgs

    from qurl_mcore.models.registry import shape
    from qurl_mcore.models.tiny import tiny_checkpoint
    from qurl_mcore.plantrace import load_sglang_model, sglang_parallel
    from qurl_mcore.rollout import EngineConfig
    from qurl_mcore.sizing import hf_tensors

    hf = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    hf.update(num_hidden_layers=1, vocab_size=256, num_experts=experts, num_local_experts=experts,
              moe_intermediate_size=128)
    checkpoint = [(x.name, x.shape, x.kind) for x in hf_tensors(shape(hf))]
    experts_bf16 = [2 * math.prod(size) for _, size, kind in checkpoint if kind == "experts"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp, fake_cuda() as trace:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        cuda = torch.device("cuda", 0)
        kwargs = lambda method, options: EngineConfig(tmp, method, options, device="cuda",  # noqa: E731
                                                      dtype="bfloat16").engine_kwargs()
        with sglang_parallel(kwargs(*cases[0]), 1):
            for method, options in cases:
                trace.reset_peak()
                base = trace.live_bytes
                model = load_sglang_model(ServerArgs(**kwargs(method, options)), lambda: (
                    (n, torch.empty(size, dtype=torch.bfloat16, device=cuda)) for n, size, _ in checkpoint))
                moe = model.model.layers[0].mlp.experts
                codes = sum(t.untyped_storage().nbytes() for q in (moe.qurl_w13_weight, moe.qurl_w2_weight)
                            for t in (q.data, q.scale, q.global_scale) if t is not None)
                out[f"{method} {options}"] = {
                    "peak": trace.peak_bytes - base, "after": trace.live_bytes - base, "expert_codes": codes,
                    "experts_bf16": sum(experts_bf16), "expert_w13_bf16": 2 * max(experts_bf16),
                    "others_bf16": sum(2 * math.prod(size) for _, size, kind in checkpoint if kind != "experts")}
                del model, moe
    return out
