"""The experts an engine of TP 2 or EP 2 quantizes as they load are, on every rank, bitwise what quantizing each
of its expert matrices after a load in bf16 installs. A code push into such an engine installs, on every rank,
bitwise what a BF16 push and the rank's own re-quantization of its shard install, and the refit check's digests,
gathered over the ranks, equal the trainer's. Each rank is a real SGLang model (SGLang's model classes, weight
loaders, FusedMoE and its expert placement) in its own process, with SGLang's TP/EP process groups built over
gloo, loaded and refitted as SGLang's model loader does (`DefaultModelLoader.postprocess_weights` /
`restore_weights_before_loading`) but without the scheduler and its forward (a TP-2 CPU engine does not start on
a one-NUMA-node machine unless SGLANG_CPU_OMP_THREADS_BIND gives each rank its cores). Both ranks' imports make
it the slow lane."""
from __future__ import annotations

import multiprocessing
import socket
import traceback
import types

import pytest
import torch

from qurl_mcore.recipe import engine_recipe
from qurl_mcore.rollout import EngineConfig
from qurl_mcore.rollout.codes import CodePush, engine_units
from qurl_mcore.transfer import buckets
from tests.sglang.conftest import checkpoint_tensors, model_path, noisy_layer0

pytestmark = pytest.mark.slow

#: (model, method, format, scope): every format, dense and MoE, both scopes
CASES = [("qwen3", "qurl_int8", "int8", "all"), ("qwen3_moe", "qurl_int8", "int8", "all"),
         ("qwen3", "qurl_fp8", "fp8_e4m3", "all"), ("qwen3_moe", "qurl_fp8", "fp8_e4m3", "all"),
         ("qwen3", "qurl_fp4", "nvfp4", "all"), ("qwen3_moe", "qurl_fp4", "nvfp4", "all"),
         ("qwen3", "qurl_fp4_rc", "mxfp4", "all"), ("qwen3_moe", "qurl_fp4_rc", "mxfp4", "all"),
         ("qwen3_moe", "qurl_fp4_rc", "nvfp4", "experts"), ("qwen3_moe", "qurl_fp4", "mxfp4", "experts")]
#: small buckets, so that units straddle them
BUCKET = 96 << 10


def _model(arch: str, method: str, options: dict):
    """This rank's SGLang model of `arch` under the plugin's `method`, loaded from its checkpoint as SGLang loads."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from transformers import AutoConfig

    from qurl_mcore.sglang.options import QurlOptions
    from qurl_mcore.sglang.quant_config import CONFIGS

    path = model_path(arch)
    cls = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}[arch]
    with set_default_torch_dtype(torch.bfloat16):
        model = cls(AutoConfig.from_pretrained(path), quant_config=CONFIGS[method](QurlOptions.parse(method, options)))
    model.load_weights(checkpoint_tensors(path).items())
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    return model


def _push(model, tensors) -> None:
    """One update session, as SGLang's begin/update/end_weight_update run it."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    model.load_weights(tensors)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def _installed(model) -> dict[str, list[bytes]]:
    """Every quantized tensor the rank serves: its codes, scales and global scale as bytes (plain bytes cross to
    the parent, where tensors would travel as handles to the rank's shared memory)."""
    out = {}
    for name, module in model.named_modules():
        for attr in ("qurl_weight", "qurl_w13_weight", "qurl_w2_weight"):
            q = getattr(module, attr, None)
            if q is not None:
                out[f"{name}.{attr}"] = [t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                         for t in (q.data, q.scale, q.global_scale) if t is not None]
    return out


def _experts(model) -> dict[str, list[bytes]]:
    """`_installed` of the FusedMoEs alone."""
    return {n: b for n, b in _installed(model).items() if ".experts." in n}


def _loaded_reference(model, tensors: dict[str, torch.Tensor], spec) -> dict[str, list[bytes]]:
    """`_installed` of each FusedMoE of `model` as SGLang's load in bf16 followed by the quantization of each
    expert matrix would install them: per expert of this rank, `quantize_weight` of the rank's shard (`quant.wire`)
    of the checkpoint's [gate; up] and of its down projection, in bf16."""
    from qurl_mcore.quant import quantize_weight
    from qurl_mcore.quant.wire import COLUMNS, ROWS, shard
    from qurl_mcore.sglang import weights

    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "qurl_w13_weight"):
            pre = f"{name}.".replace(".mlp.experts.", ".mlp.experts.{}.")
            tp_rank, tp_size = module.moe_tp_rank, module.moe_tp_size
            ids = weights.global_experts(module)
            w = {n: [tensors[pre.format(ids[e]) + f"{n}.weight"].to(torch.bfloat16) for e in sorted(ids)]
                 for n in ("gate_proj", "up_proj", "down_proj")}
            w13 = [torch.cat([shard(g, ROWS, tp_rank, tp_size), shard(u, ROWS, tp_rank, tp_size)])
                   for g, u in zip(w["gate_proj"], w["up_proj"])]
            w2 = [shard(d, COLUMNS, tp_rank, tp_size) for d in w["down_proj"]]
            for attr, mats in (("qurl_w13_weight", w13), ("qurl_w2_weight", w2)):
                q, _ = weights.stack([quantize_weight(m, spec) for m in mats])
                out[f"{name}.{attr}"] = [t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                         for t in (q.data, q.scale, q.global_scale) if t is not None]
    return out


def _rank(rank: int, port: int, tp: int, ep: int, results) -> None:
    """One engine rank: every case's BF16 and code pushes (full, then partial), what it installed and reported."""
    try:
        results.put((rank, _pushes(rank, port, tp, ep)))
    except BaseException:  # the parent names the rank that failed, instead of waiting for it
        results.put((rank, traceback.format_exc()))
        raise


def _pushes(rank: int, port: int, tp: int, ep: int) -> dict:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from qurl_mcore.sglang import weights

    torch.set_num_threads(1)
    load_plugins()
    out = {}
    engine = EngineConfig(model_path("qwen3_moe"), "qurl_int8", device="cpu", dtype="bfloat16",
                          extra={"tp_size": tp, "ep_size": ep})
    with use_context(create_context(ServerArgs(**engine.engine_kwargs()), role="scheduler",
                                    ranks=SpawnRanks(world_rank=rank))), torch.no_grad():
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel()
        for arch, method, fmt, scope in CASES:
            path = model_path(arch)
            checkpoint = checkpoint_tensors(path)
            recipe = engine_recipe(method, fmt, scope)
            units = engine_units(path, recipe.groups, tp, ep)
            full = {k: v.to(torch.bfloat16) for k, v in noisy_layer0(checkpoint_tensors(path)).items()}
            part = sorted(units)[-1]  # one weight (a whole unit for NVFP4)
            partial = ({n: full[n] * 1.5 for n in units[part].names} if fmt == "nvfp4"
                       else {part: full[part] * 1.5})
            case = {}
            for push in ("bf16", "codes"):
                model = _model(arch, method, {"fmt": fmt, "scope": scope, "push": push})
                case[push, "loaded"] = _experts(model), _loaded_reference(model, checkpoint, recipe.spec)
                if push == "bf16" and arch == "qwen3_moe":  # one expert's gate alone: its up is the master's
                    gate = next(n for n in sorted(checkpoint) if n.endswith(".experts.1.gate_proj.weight"))
                    half = {**checkpoint, gate: checkpoint[gate] * 1.5}
                    _push(model, [(gate, half[gate])])
                    case["half"] = _experts(model), _loaded_reference(model, half, recipe.spec)
                exporter = types.SimpleNamespace(get_model=lambda: model)  # what report_digests reads of SGLang's
                for step, tensors in (("full", full), ("partial", partial)):
                    codes = CodePush(recipe.spec, units, send=push == "codes")
                    _push(model, [nt for b in codes.buckets(buckets(tensors.items(), BUCKET)) for nt in b])
                    reported = weights.report_digests(None, exporter, weights.DIGESTS)
                    case[push, step] = _installed(model), reported, dict(codes.digests)
            out[arch, method, fmt, scope] = case
    return out


def _ranks(tp: int, ep: int) -> list[dict]:
    """Each rank's results of `_rank`, ranks in fresh processes of their own (SGLang decides at import that it
    runs on CPU, from the engine's environment)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, tp, ep, results)) for r in range(tp)]
    with pytest.MonkeyPatch.context() as env:
        for k, v in EngineConfig(model_path("qwen3"), device="cpu").environment().items():
            env.setenv(k, v)
        for p in procs:
            p.start()
    got = {}
    try:
        while len(got) < tp:
            rank, out = results.get(timeout=900)
            assert not isinstance(out, str), f"engine rank {rank} failed:\n{out}"
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(tp)]


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["tp2", "ep2"])
def ranks(request) -> tuple[tuple[int, int], list[dict]]:
    return request.param, _ranks(*request.param)


@pytest.mark.parametrize("case", CASES, ids=["-".join((c[0], c[2], c[3])) for c in CASES])
def test_a_sharded_code_push_installs_what_a_bf16_push_and_each_ranks_requantization_install(ranks, case):
    (tp, ep), per_rank = ranks
    for rank, out in enumerate(per_rank):
        results = out[case]
        # the experts quantized as they load: what quantizing them after a load installs; after a bf16 push of
        # one expert's gate alone, what quantizing that expert's new gate and old up installs
        for step in [("bf16", "loaded"), ("codes", "loaded")] + (["half"] if "half" in results else []):
            got, want = results[step]
            assert got.keys() == want.keys() and (got or case[0] != "qwen3_moe")
            assert not [n for n in want if want[n] != got[n]], (rank, step)
        for step in ("full", "partial"):
            (want, want_digests, bf16), (got, got_digests, codes) = results["bf16", step], results["codes", step]
            assert want.keys() == got.keys() and want
            bad = [n for n in want if want[n] != got[n]]
            assert not bad, (rank, step, bad)
            assert got_digests == want_digests, (rank, step)
            if step == "full":  # the refit check of either push: the trainer's digests of every rank's shards
                assert codes and codes == bf16 == got_digests, rank
    # the partial push changed a unit (under EP, on the rank that holds it)
    assert any(out[case]["bf16", "full"][0] != out[case]["bf16", "partial"][0] for out in per_rank)
    digests = per_rank[0][case]["codes", "full"][1]
    shards = {len(d.split(",")) for d in digests.values()}
    moe = case[0] == "qwen3_moe"
    # TP ranks each hold a shard of every dense unit; under EP 2 an expert lives whole on one rank
    assert shards == ({1} if case[3] == "experts" and ep == 2 else {1, 2} if moe and ep == 2 else {tp})
