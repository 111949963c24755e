"""Per-rank bodies of the world-size-2 tests (module-level so that `spawn` can import them in the children).
Each returns plain tensors and flags; the test process compares them with its own world-size-1 and HF
references."""
from __future__ import annotations

import torch
import torch.distributed as dist

from qurl_mcore.megatron.convert import export_hf_weights, load_hf_weights, read_hf_state
from qurl_mcore.megatron.logprobs import token_logprobs
from qurl_mcore.megatron.gpt import build_gpt, gpt_config
from qurl_mcore.megatron.parallel import init_parallel
from qurl_mcore.megatron.rescaling import apply_uaq
from qurl_mcore.recipe import resolve


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[b, s, V]: the vocab-parallel logits gathered over TP."""
    with torch.no_grad():
        return _gather(model(ids, torch.arange(ids.shape[1]).expand_as(ids), None), -1)


def round_trip_mismatches(model, path) -> list[str]:
    original = read_hf_state(path)
    exported = dict(kv for b in export_hf_weights(model, path, dtype=torch.bfloat16, bucket_bytes=1 << 20) for kv in b)
    return sorted(set(original) ^ set(exported)) + [k for k in original if k in exported
                                                   and not torch.equal(original[k], exported[k])]


def quantized_step(path, ids, precision: str, scope: str, fmt: str) -> dict:
    """Log-probs of a quantized model and its gradients (gathered over TP) after backward of their sum."""
    model = build_gpt(path, recipe=resolve(precision, scope, fmt))
    load_hf_weights(model, path)
    out = token_logprobs(model, ids, grad=True)
    out.logprobs.sum().backward()
    params = dict(model.named_parameters())
    return {
        "logprobs": out.logprobs.detach(),
        "grad_qkv": _gather(params["decoder.layers.0.self_attention.linear_qkv.weight"].grad, 0),
        "grad_proj": _gather(params["decoder.layers.1.self_attention.linear_proj.weight"].grad, 1),
    }


def dense_tp2(rank: int, path, ids: torch.Tensor) -> dict:
    """Tiny Qwen3, TP=2 with sequence parallelism."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from qurl_mcore.megatron.spec import gpt_spec

    init_parallel(tensor_parallel=2)
    model = build_gpt(path)
    load_hf_weights(model, path)
    result = {"logits": full_logits(model, ids), "logprobs": token_logprobs(model, ids).logprobs,
              "round_trip": round_trip_mismatches(model, path)}
    apply_uaq(model, 1.5)
    result["uaq_logits"] = full_logits(model, ids)
    result["quant"] = quantized_step(path, ids, "fp4_rc", "all", "mxfp4")

    # precision bf16 = the stock local spec, at TP=2 (without SP, which the stock torch norm refuses)
    config = gpt_config(path, sequence_parallel=False)
    kw = dict(config=config, vocab_size=49152, max_sequence_length=64, position_embedding_type="rope")
    outs = []
    for spec in (get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), gpt_spec(config)):
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        outs.append(full_logits(GPTModel(transformer_layer_spec=spec, **kw), ids))
    result["bf16_equals_stock"] = torch.equal(outs[0], outs[1])
    return result


def other_routing(routes: torch.Tensor) -> torch.Tensor:
    """A top-2 of 4 experts the router did not choose, for every token and layer: its set shifted by one
    ({a, b} → {a+1, b+1} mod 4 never maps a pair onto itself); [b, s, layers, k] from routes [layers, b, s, k]."""
    return (routes.permute(1, 2, 0, 3) + 1) % 4


def replayed(model, ids: torch.Tensor, target: torch.Tensor) -> dict:
    """Log-probs and routes of `model` on `ids` with its routers replaying `target` (R3)."""
    from qurl_mcore.megatron.replay import RoutingTaps

    taps = RoutingTaps(model)
    taps.replay(target)
    try:
        out = token_logprobs(model, ids, return_routed_experts=True)
    finally:
        taps.replay(None)
    return {"target": target, "logprobs": out.logprobs, "routes": out.routed_experts}


def moe_tp2_ep2(rank: int, path, ids: torch.Tensor) -> dict:
    """Tiny Qwen3-MoE, TP=2 with sequence parallelism and EP=2 (each rank holds 2 of the 4 experts)."""
    init_parallel(tensor_parallel=2, expert_parallel=2)
    model = build_gpt(path)
    load_hf_weights(model, path)
    out = token_logprobs(model, ids, return_routed_experts=True)
    result = {"logits": full_logits(model, ids), "logprobs": out.logprobs, "routes": out.routed_experts,
              "round_trip": round_trip_mismatches(model, path),
              "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts)}
    result["replayed"] = replayed(model, ids, other_routing(out.routed_experts))
    apply_uaq(model, 2.0)
    result["uaq_logits"] = full_logits(model, ids)
    result["quant"] = quantized_step(path, ids, "fp4_rc", "experts", "nvfp4")
    return result


def fail_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def listening_addresses(rank: int) -> list[str]:
    """The addresses this rank's own sockets listen on, once Megatron's groups are up and have talked."""
    import psutil

    init_parallel(2)
    t = torch.ones(1)
    dist.all_reduce(t)
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"})


def refusals(rank: int, paths: list) -> list[str]:
    """What loading each checkpoint of `paths` into a tiny DeepSeek-V3 at EP=2 (each rank 4 of the 8 experts,
    so no rank reads every tensor) raises on this rank ("" where it loads)."""
    init_parallel(expert_parallel=2)
    out = []
    for path in paths:
        try:
            load_hf_weights(build_gpt(path), path)
            out.append("")
        except ValueError as err:
            out.append(str(err))
    return out


#: (name, recipe) pairs whose grouped experts are compared with SequentialMLP: full precision, the FP4 rows,
#: and per-token INT8 / FP8 (emulated) training of the experts
def grouped_recipes():
    from dataclasses import replace

    from qurl_mcore.quant import make_spec

    fp4 = resolve("fp4", "experts", "nvfp4")
    return [("bf16", resolve("bf16")), ("fp4-nvfp4", fp4), ("fp4_rc-nvfp4", resolve("fp4_rc", "experts", "nvfp4")),
            ("fp4_rc-mxfp4", resolve("fp4_rc", "experts", "mxfp4")), ("fp4_rc-hif4", resolve("fp4_rc", "experts", "hif4")),
            ("int8", replace(fp4, fmt="int8", train=make_spec("rc_none", "int8"))),
            ("fp8_e4m3", replace(fp4, fmt="fp8_e4m3", train=make_spec("rc_both", "fp8_e4m3")))]


def grouped_vs_sequential(path, ids: torch.Tensor, recipe) -> dict:
    """The largest |grouped − sequential| of the log-probs, of every gradient after backward of their sum, and of
    every parameter after one Adam step, for models with the same weights that differ only in the experts
    module; also the experts module each built."""
    from qurl_mcore.megatron.spec import EXPERT_MODULES

    out = {}
    for experts in EXPERT_MODULES:
        model = build_gpt(path, recipe=recipe, experts=experts)
        load_hf_weights(model, path)
        lp = token_logprobs(model, ids, grad=True).logprobs
        lp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.optim.Adam(model.parameters(), lr=1e-3).step()
        out[experts] = (lp.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()},
                        type(model.decoder.layers[0].mlp.experts).__name__)
    (lp_g, grads_g, params_g, kind_g), (lp_s, grads_s, params_s, kind_s) = out["grouped"], out["sequential"]
    diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    return {"modules": (kind_g, kind_s), "logprobs": (lp_g - lp_s).abs().max().item(),
            "grads": diff(grads_g, grads_s), "params": diff(params_g, params_s),
            "expert_grad": max(g.abs().max().item() for n, g in grads_s.items() if "local_experts" in n)}


def grouped_ep2(rank: int, path, ids: torch.Tensor) -> dict:
    """`grouped_vs_sequential` for every `grouped_recipes` recipe at EP=2 (each rank holds 2 of the 4 experts)."""
    init_parallel(expert_parallel=2)
    return {name: grouped_vs_sequential(path, ids, recipe) for name, recipe in grouped_recipes()}
