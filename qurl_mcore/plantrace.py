"""`qurl plan --trace`: the bytes a GPU would hold, measured by running the real code on fake CUDA devices
(`qurl_mcore.fakecuda`), beside the plan's figures (`qurl_mcore.sizing`).

Trainer: the rank of the fullest pipeline stage (the one `sizing.memory.trainer_bytes` plans) is built as
`loop.trainer.PolicyTrainer` builds it, at the model's full size from its config.json or architecture card (no
weights are read: a fake tensor has no values), and stepped once on one micro-batch of
`train.micro_batch_size` rows of `rollout.context_length` tokens on every data-parallel rank. Its peak is the
most CUDA bytes alive at once over the build and the step (forward, backward, Megatron's DDP reduce, the
optimizer's update: a traced step never reads a loss or a norm, so the update is always taken, and the
optimizer's states are allocated as at a real first step), then a push's export: every HF tensor gathered from
its shards, cast to rollout.dtype and bucketed as `loop.trainer.PolicyTrainer.weight_stream` gives it, and
broadcast over the NCCL-like group as a disaggregated push sends it.

Each trace runs in a fresh process (`fakecuda.run_traced`). docs/plan.md says which terms of the plan the
trace checks and which it cannot.
"""
from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .fakecuda import fake_cuda, run_traced
from .models.registry import shape
from .precision import quantized_linears
from .sizing import engine_bytes, hf_tensors, push_bytes, trainer_bytes
from .sizing.gpus import get_gpu
from .sizing.verdict import export_bytes

#: a traced peak further than this from the plan's is a disagreement (`qurl plan --trace` says so)
TOLERANCE = 0.15
#: a model with more layers per pipeline stage than this is traced at 1 and 2 layers per stage and each phase's
#: peak extrapolated to the whole stack (every term the plan has is linear in the layers of a stage)
MAX_TRACED_LAYERS = 8
#: `qurl plan --gpu` names -> the façade's GPUs (`fakecuda.GPUS`)
_FAKE_GPU = {"h100-80g": "H100-80GB", "h200-141g": "H200", "b200-180g": "B200"}
_PLAN_GPU = {v: k for k, v in _FAKE_GPU.items()}
#: why a mixture-of-experts trainer rank is traced through its build only
MOE_STEP = ("Megatron's all-to-all token dispatcher copies the tokens per expert to the host to size its "
            "collectives (token_dispatcher.py, maybe_move_tensor_to_cpu), and a fake tensor has no values to copy")
#: the phases of a step whose peaks are measured apart (in this order)
PHASES = ("build", "before_training", "forward_backward", "optimizer", "update_capture", "push")


def trace_trainer(cfg: Config, hf: dict[str, Any], gpu: str = "H100-80GB", timeout: float = 900.0) -> dict[str, Any]:
    """The traced trainer rank of `cfg` for the model of config.json `hf` (module docstring), beside the plan:
    `measured_peak_bytes` and `planned_peak_bytes` (the plan's peak with a push's export, `peak_with_push`),
    the peak of each phase (`phases`: the states after the build, what runs before training (no-grad log-prob
    passes, the update-capture metric's copy), the forward and backward, the optimizer's update, the
    update-capture metric after it, a push's export), the layers traced per pipeline stage, and the seconds the
    trace took."""

    s = shape(hf)
    plan = trainer_bytes(s, cfg)
    export = export_bytes(cfg, plan, push_bytes(s, cfg))
    t = cfg.train
    world = t.tp_size * t.pp_size * t.dp_size
    # the first rank of the fullest stage: Megatron's rank order puts the pipeline stage outermost
    rank = plan["stage"] * (world // t.pp_size)
    per_stage = s.layers // t.pp_size
    step = not s.experts
    start = time.perf_counter()
    if per_stage <= MAX_TRACED_LAYERS:
        phases, traced = run_traced(_trainer_step, cfg, hf, rank, world, gpu, step, timeout=timeout), per_stage
        phases.pop("push_start")
    else:  # per phase: p(L) = p(2) + (L − 2)·(p(2) − p(1)), L layers per stage
        one, two = (run_traced(_trainer_step, cfg, {**hf, "num_hidden_layers": n * t.pp_size}, rank, world, gpu,
                               step, timeout=timeout) for n in (1, 2))
        phases = {k: two[k] + (per_stage - 2) * (two[k] - one[k]) for k in two}
        # but the push's: the states it starts from grow with the layers, its gathered tensor and bucket do not
        start = phases.pop("push_start")
        phases["push"] = start + max(r["push"] - r["push_start"] for r in (one, two))
        traced = [1, 2]
    which = "distributed" if plan["distributed_optimizer"] else "replicated"
    out = {"measured_peak_bytes": max(phases.values()), "planned_peak_bytes": max(plan["peak"], export),
           "step_traced": step, "phases": phases,
           "planned": {"static": plan["static"], "activations": plan["activations"][t.recompute],
                       "update_capture": plan["update_capture"], "push": export},
           "rank": rank, "world_size": world, "layers_traced_per_stage": traced}
    if not step:  # the build and a push only: the states without Adam's (a first update allocates them)
        adam = plan["optimizer"][which]
        out.update(planned_peak_bytes=max(plan["static"], export) - adam, why=MOE_STEP)
        out["planned"]["push"] -= adam
    return {**out, "seconds": round(time.perf_counter() - start, 1)}


def _trainer_step(cfg: Config, hf: dict[str, Any], rank: int, world: int, gpu: str, step: bool) -> dict[str, int]:
    """In the traced process: build the trainer rank, (`step`) step it once and export a push
    (`trace_trainer`); the peak CUDA bytes of each of `PHASES` (the build's and the push's only without a
    step)."""
    # Megatron-Core, in the traced process only
    import qurl_mcore.megatron as megatron
    import qurl_mcore.megatron.training as training
    from qurl_mcore.loop.trainer import PolicyTrainer

    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        cfg = copy.deepcopy(cfg)
        cfg.model.path = tmp
        megatron.load_hf_weights = lambda model, hf_dir: None  # no weights: a fake tensor holds no values
        with fake_cuda(devices=min(8, world), world_size=world, rank=rank, device=rank % 8, gpu=gpu) as trace:

            def mark(name):  # the peak since the last mark belongs to phase `name`
                peaks[name] = max(peaks.get(name, 0), trace.peak_bytes)
                trace.reset_peak()

            def phase(name, fn):
                def run(*args, **kwargs):
                    mark("before_training")  # log-prob passes (reference, π_prox), the capture's copy
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        mark(name)
                return run

            training.forward_backward = phase("forward_backward", training.forward_backward)
            # a traced loss and norm have no values (they read 1): take the update, as a finite step does
            take = phase("optimizer", training.step)
            training.step = lambda stack, clip_grad, skip=False: take(stack, clip_grad, False)
            trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world)
            # the states after the build (its passing copies, one tensor's at a time, do not grow with the layers
            # as the states do: a peak of 1 or 2 layers does not extrapolate)
            peaks["build"] = torch.cuda.memory_allocated()
            trace.reset_peak()
            if step:
                _step(trainer, cfg)
            mark("update_capture" if step else "build")
            peaks["push_start"] = torch.cuda.memory_allocated()  # what the push starts from (trace_trainer)
            _push(trainer)
            mark("push")
            trainer.close()
    return {k: peaks[k] for k in (*PHASES, "push_start") if k in peaks}


def _step(trainer, cfg: Config) -> None:
    """One step on a micro-batch of `train.micro_batch_size` rows of `rollout.context_length` tokens per
    data-parallel rank."""
    from qurl_mcore.loop.batch import TrainBatch

    t = cfg.train
    rows, width = t.micro_batch_size * t.dp_size, cfg.rollout.context_length
    ones = torch.ones(rows, width, dtype=torch.bool)
    batch = TrainBatch(torch.zeros(rows, width, dtype=torch.long), ones, ones.clone(), torch.zeros(rows, width),
                       torch.zeros(rows))
    trainer.step(batch)  # after the optimizer's phase: the update-capture metric


def _push(trainer) -> None:
    """A push's export (unsmoothed: rollout.smoothing's fold, one tensor at a time in fp32, is not traced),
    broadcast bucket by bucket over the default group, which refuses host tensors as NCCL does."""
    from qurl_mcore.rollout.broadcast import WeightSender

    sender = WeightSender(None, "qurl-trace", "nccl", torch.distributed.get_world_size())
    with trainer.weight_stream() as stream:
        for bucket in stream:
            sender.send(bucket)


def trace_engine(cfg: Config, hf: dict[str, Any], gpu: str = "H100-80GB", timeout: float = 900.0) -> dict[str, Any]:
    """One engine GPU's weights after a load, traced: the plugin's quantizer (`sglang.linear.QurlLinearMethod`,
    what `process_weights_after_loading` runs on every load and push) on this GPU's shard (rows /
    rollout.tp_size) of each linear of one decoder layer that the engines quantize, times the layers, plus every
    other tensor in rollout.dtype (norms and routers whole, the rest /TP). `measured_peak_bytes` is that
    residency plus the most the quantization of one tensor holds besides; `planned_peak_bytes` the plan's
    weights per GPU (`engine_bytes(...)["weights"]["gpu_weights"]`). The KV cache and SGLang's reserve
    (the rest of the plan's engine peak) are not traced: SGLang's model runner cannot start on the façade
    (docs/plan.md)."""

    s = shape(hf)
    plan = engine_bytes(s, cfg, get_gpu(_PLAN_GPU.get(gpu, gpu)))
    start = time.perf_counter()
    out = run_traced(_engine_weights, cfg, hf, gpu, timeout=timeout)
    return {"measured_peak_bytes": out["weights"] + out["transient"], "planned_peak_bytes": plan["weights"]["gpu_weights"],
            "measured_weight_bytes": out["weights"], "quantize_transient_bytes": out["transient"],
            "not_traced": {"kv": plan["kv"], "reserve": plan["reserve"]},
            "seconds": round(time.perf_counter() - start, 1)}


def _engine_weights(cfg: Config, hf: dict[str, Any], gpu: str) -> dict[str, int]:
    """In the traced process: `trace_engine`'s bytes of one engine GPU."""
    # SGLang, in the traced process only
    from qurl_mcore.sglang.linear import QurlLinearMethod
    from qurl_mcore.sglang.options import QurlOptions

    s = shape(hf)
    tp = cfg.rollout.tp_size
    engine = cfg.recipe().engine
    method = QurlLinearMethod(QurlOptions(recipe=engine)) if engine else None
    precision, scope, _ = cfg.resolved_precision()
    c = {"model_type": s.model_type, "num_hidden_layers": s.layers, "num_experts": s.experts,
         "shared_expert_intermediate_size": s.shared_intermediate}
    names = {n + ".weight" for n in quantized_linears(c, precision.name, scope, "rollout")} if engine else set()
    dtype = getattr(torch, cfg.rollout.dtype)
    kept, transient = [], 0
    with fake_cuda(gpu=gpu) as trace:
        def resident() -> int:
            return torch.cuda.memory_allocated()

        outside = 0
        for x in hf_tensors(s):
            if x.layer not in (None, 0):
                continue
            rows = x.shape[0] if x.kind in ("norm", "router") else -(-x.shape[0] // tp)
            before = resident()
            trace.reset_peak()
            w = torch.empty(rows, *x.shape[1:], dtype=dtype, device="cuda")
            if x.name in names:
                q = method.quantize_weight(w, method.spec)
                del w  # the master goes to the host (or stays beside it: --master device, not counted here)
                kept.append(q)
            else:
                kept.append(w)
            transient = max(transient, trace.peak_bytes - resident())
            if x.layer is None:
                outside += resident() - before
        layer = resident() - outside
    return {"weights": outside + s.layers * layer, "transient": transient}


def trace_plan(cfg: Config, hf: dict[str, Any], gpu: str = "h100-80g") -> dict[str, Any]:
    """What `qurl plan --trace` adds to the plan of `cfg` on `gpu` (a `qurl plan --gpu` name): the traced
    trainer rank (`trace_trainer`) and engine GPU (`trace_engine`), each with `measured_peak_bytes`,
    `planned_peak_bytes` and `agree` (within `TOLERANCE`)."""

    fake = _FAKE_GPU.get(get_gpu(gpu).name)
    if fake is None:
        raise ValueError(f"--gpu {gpu}: the trace pretends to be one of {sorted(_FAKE_GPU)}")
    out = {"trainer": trace_trainer(cfg, hf, fake), "engine": trace_engine(cfg, hf, fake)}
    for side in out.values():
        side["agree"] = abs(side["measured_peak_bytes"] - side["planned_peak_bytes"]) <= \
            TOLERANCE * side["planned_peak_bytes"]
    return out


def format_trace(trace: dict[str, Any]) -> str:
    """The lines `qurl plan --trace` prints after the plan."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    t, e = trace["trainer"], trace["engine"]
    layers = t["layers_traced_per_stage"]
    how = (f"all {layers} layers of its stage" if isinstance(layers, int) else
           "1 and 2 layers per stage, each phase's peak extrapolated to the stage's layers")
    phases = ", ".join(f"{k} {gib(v)}" for k, v in t["phases"].items())
    lines = [
        f"trace     trainer rank {t['rank']} of {t['world_size']} on fake CUDA ({how}; {t['seconds']:.0f} s): "
        + (f"measured peak {gib(t['measured_peak_bytes'])}, planned {gib(t['planned_peak_bytes'])} ({_diff(t)}); "
           f"per phase: {phases}" if t["step_traced"] else
           f"built and a push's export only, measured {gib(t['measured_peak_bytes'])}, planned without Adam's "
           f"states {gib(t['planned_peak_bytes'])} ({_diff(t)}); per phase: {phases}; no step: {t['why']}")
        + f"; push's export planned {gib(t['planned']['push'])}",
        f"trace     engine GPU weights after a load (the plugin's quantizer on one layer, times the layers; "
        f"{e['seconds']:.0f} s): measured {gib(e['measured_peak_bytes'])} (of it {gib(e['quantize_transient_bytes'])} "
        f"while one tensor is quantized), planned {gib(e['planned_peak_bytes'])} ({_diff(e)}); KV cache and "
        f"SGLang's reserve not traced",
    ]
    lines += [f"problem   trace: the {who}'s measured peak differs from the plan's by more than "
              f"{TOLERANCE:.0%}: the plan misses a term, or the trace one (docs/plan.md)"
              for who, side in trace.items() if not side["agree"]]
    return "\n".join(lines)


def _diff(side: dict[str, Any]) -> str:
    planned = side["planned_peak_bytes"]
    return f"{(side['measured_peak_bytes'] - planned) / planned:+.1%}" if planned else "nothing planned"
