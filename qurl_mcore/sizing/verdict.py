"""Whether a run fits its GPUs: the peak of each kind of GPU the layout has (trainer, engine, or one GPU holding
both when colocated), for one that does not fit the single config changes (levers) that make it fit, the nodes
the placement fills, and the whole `Plan` that `qurl plan` prints."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config
from ..models.cards import card
from ..models.registry import shape
from ..models.slots import Shape
from ..placement import placement_of
from .gpus import GPU, LINK_NAMES, GiB, get_gpu, link_gb_s
from .memory import RECOMPUTE_ORDER, _kv_beside, engine_bytes, trainer_bytes, update_capture_bytes
from .speed import MEASURED_PUSH, push_bytes, push_seconds, rollout_ceiling
from .tensors import parameter_count


@dataclass
class Plan:
    """What `qurl plan` prints: one dict per section, and `problems` (empty: every GPU fits)."""

    model: dict[str, Any]
    hardware: dict[str, Any]
    trainer: dict[str, Any]
    engines: dict[str, Any]
    push: dict[str, Any]
    rollout: dict[str, Any]
    verdict: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether every kind of GPU of the layout holds its peak (and an engine's KV cache one sequence)."""
        return all(row["fits"] for row in self.verdict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("model", "hardware", "trainer", "engines", "push", "rollout",
                                              "verdict", "problems")}


def export_bytes(cfg: Config, trainer: dict[str, Any], push: dict[str, Any]) -> int:
    """A trainer rank's bytes while it exports a push (`trainer`: `trainer_bytes(...)`, `push`: `push_bytes(...)`):
    its states, and where the export makes copies (tensors gathered from TP, EP or pipeline peers, or cast
    or smoothed into the rollout's dtype) one bucket of them and the largest tensor twice (its gathered
    shards and their concatenation). Otherwise the buckets hold views of the parameters: nothing is added
    (the attention's q/k/v, re-laid out from Megatron's fused projection, are the exception: under 2% of the
    states, `qurl plan --trace` measures them). A broadcast push (disaggregated) adds the byte buffer each bucket
    is sent in (`rollout.broadcast.WeightSender.send`)."""
    t = cfg.train
    copies = (t.tp_size * t.pp_size * t.ep_size > 1 or cfg.rollout.smoothing > 0
              or cfg.train_dtype(cuda=True) != getattr(torch, cfg.rollout.dtype))
    sent = push["bucket_bytes"] if cfg.layout == "disaggregated" else 0
    return trainer["static"] + sent + (push["bucket_bytes"] + 2 * push["largest_tensor"] if copies else 0)


def _budget(s: Shape, cfg: Config, gpu: GPU, master: str) -> dict[str, Any]:
    """Trainer and engine bytes, the peak of each kind of GPU the layout has, and whether each fits.

    A colocated GPU holds a trainer rank and an engine. Without rollout.offload both keep their peaks at
    once. With it the engine gives its memory back while the trainer steps and the trainer empties its
    allocator's cache before the engine takes it again, so the GPU's peak is the larger of
      training   the trainer's peak + what the released engine keeps
      rollout    the trainer's states (no activations) + the engine's peak
    An engine's peak is the larger of serving's (`engine_bytes`' peak) and its load's (`load`: the model as
    SGLang's loader holds it before the KV cache exists)."""
    trainer = trainer_bytes(s, cfg)
    push = push_bytes(s, cfg)
    export = export_bytes(cfg, trainer, push)
    trainer_peak = max(trainer["peak"], export)
    offload = cfg.offload_rollout(cuda=True)
    colocated = cfg.layout == "colocated"
    resident = export if offload else trainer_peak  # what a trainer rank holds while its engine is up
    r = cfg.rollout
    beside = resident if colocated and not r.max_total_tokens and not r.mem_fraction else None
    engine = engine_bytes(s, cfg, gpu, master, None if beside is None else _kv_beside(s, cfg, gpu, master, beside))
    kv_ok = engine["kv_tokens"] >= r.context_length
    engine_peak = max(engine["peak"], engine["load"])
    if colocated:
        shared = max(trainer_peak + engine["released"], resident + engine_peak) if offload else \
            trainer_peak + engine_peak
        gpus = {"trainer+engine": (shared, kv_ok)}
        if r.engines < cfg.train.world_size:
            gpus["trainer"] = (trainer_peak, True)
    else:
        gpus = {"trainer": (trainer_peak, True), "engine": (engine_peak, kv_ok)}
    fits = {who: peak <= gpu.hbm and ok for who, (peak, ok) in gpus.items()}
    return {"trainer": trainer, "trainer_peak": trainer_peak, "engine": engine, "push": push, "beside": beside,
            "resident": resident, "offload": offload, "gpus": {who: peak for who, (peak, _) in gpus.items()},
            "fits": fits}


def _override(cfg: Config, changes: dict[str, Any]) -> Config:
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def _levers(s: Shape, cfg: Config, master: str, gpus_per_node: int, who: str) -> list[tuple[str, Config, str]]:
    """(label, changed config, master) for each single change that lowers the bytes of `who`'s GPU."""
    t, r = cfg.train, cfg.rollout
    changes: list[dict[str, Any]] = []
    if "trainer" in who:
        if not cfg.distributed_optimizer(True):
            changes.append({"train.distributed_optimizer": True})
        changes += [{"train.recompute": x} for x in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(t.recompute) + 1:]]
        if cfg.logging.update_capture and any(x["end"] for x in update_capture_bytes(s, cfg)):
            changes.append({"logging.update_capture": False})
        changes += [{"train.micro_batch_size": m}
                    for m in sorted({t.micro_batch_size >> k for k in range(1, 6)} - {0}, reverse=True)]
        # the same GPUs split another way (colocated: one engine per trainer rank at most)
        half = {"train.dp_size": t.dp_size // 2}
        if cfg.layout == "colocated" and r.engines > t.world_size // 2:
            half["rollout.engines"] = t.world_size // 2
        tp2 = 2 * t.tp_size
        if t.dp_size % 2 == 0 and tp2 <= gpus_per_node and not (s.heads % tp2 or s.kv_heads % tp2):
            changes.append({"train.tp_size": tp2, **half})
        if t.dp_size % 2 == 0 and s.layers % (2 * t.pp_size) == 0:
            changes.append({"train.pp_size": 2 * t.pp_size, **half})
        if s.experts and s.experts % (2 * t.ep_size) == 0 and (t.tp_size * t.dp_size) % (2 * t.ep_size) == 0:
            changes.append({"train.ep_size": 2 * t.ep_size})
    rtp2 = 2 * r.tp_size
    if who == "engine" and rtp2 <= gpus_per_node and not (s.heads % rtp2 or s.kv_heads % rtp2):
        changes.append({"rollout.tp_size": rtp2})
    levers = [(", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in c.items()),
               _override(cfg, c), master) for c in changes]
    if "engine" in who and master == "device":
        levers.append(("--master host (the plugin's default)", cfg, "host"))
    return levers


def _verdict(s: Shape, cfg: Config, gpu: GPU, master: str, gpus_per_node: int,
             budget: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per kind of GPU (peak, margin, fits, the single levers that make it fit) and the problems."""
    rows, problems = [], []
    r = cfg.rollout
    for who, peak in budget["gpus"].items():
        row = {"gpu": who, "peak_gib": peak / GiB, "hbm_gib": gpu.hbm / GiB, "margin_gib": (gpu.hbm - peak) / GiB,
               "fits": budget["fits"][who], "fixes": []}
        rows.append(row)
        if row["fits"]:
            continue
        for label, changed, m in _levers(s, cfg, master, gpus_per_node, who):
            after = _budget(s, changed, gpu, m)
            if after["fits"].get(who):
                room = (f"a KV cache of {after['engine']['kv_tokens']} tokens beside it" if after["beside"] else
                        f"{(gpu.hbm - after['gpus'][who]) / GiB:.1f} GiB free")
                row["fixes"].append(f"{label} ({room})")
        if "engine" in who and budget["beside"] is None:
            n = _kv_beside(s, cfg, gpu, master, budget["resident"] if "trainer" in who else 0)
            if n >= r.context_length:
                row["fixes"].append(f"rollout.max_total_tokens={n} (a KV cache that fits)")
        short = "KV cache below one sequence" if peak <= gpu.hbm else f"{(peak - gpu.hbm) / GiB:.1f} GiB short"
        fixes = ("fixes (each alone): " + "; ".join(row["fixes"]) if row["fixes"] else
                 "no single lever fixes it: combine them (train.recompute, train.micro_batch_size, train.tp_size, "
                 "train.pp_size, rollout.tp_size, rollout.max_total_tokens), or use a larger GPU")
        problems.append(f"{who} GPU: {peak / GiB:.1f} GiB at its peak on a {gpu.name} ({gpu.hbm / GiB:.1f} GiB), "
                        f"{short}; {fixes}")
    engine = budget["engine"]
    if cfg.layout == "colocated" and not r.mem_fraction and budget["fits"]["trainer+engine"]:
        problems.append(f"rollout.mem_fraction: 0 lets each engine take SGLang's default share of a GPU it shares "
                        f"with a trainer rank; set rollout.mem_fraction={engine['mem_fraction']} (its weights and a KV "
                        f"cache of {engine['kv_tokens']} tokens"
                        + (", what fits beside the trainer)" if budget["beside"] is not None else ")"))
    elif r.mem_fraction and r.max_total_tokens and (engine["mem_fraction"] is None
                                                    or r.mem_fraction < engine["mem_fraction"]):
        # the tokens that rollout.mem_fraction holds: engine_bytes' fraction solved for the KV cache
        on_device = engine["peak"] - engine["kv"] - engine["reserve"]
        room = int(r.mem_fraction * gpu.hbm - engine["cuda_graphs"] - on_device - GiB)
        tokens = f"rollout.max_total_tokens={max(0, room) // engine['kv_bytes_per_token']}"
        fix = (f"use {engine['mem_fraction']}, or fewer tokens" if engine["mem_fraction"] is not None else
               f"no fraction of the GPU holds them: use at most {tokens}")
        problems.append(f"rollout.mem_fraction: {r.mem_fraction} of a {gpu.name} holds less than the engine's weights "
                        f"and its KV cache of rollout.max_total_tokens={r.max_total_tokens}; {fix}")
    return rows, problems


def _nodes_needed(cfg: Config, gpus_per_node: int) -> int:
    """Nodes of `gpus_per_node` GPUs the placement (`placement.placement_of`) fills; engines do not span nodes."""
    p = placement_of(cfg, use_gpu=True)
    trainer = math.ceil(len(p.trainer) / gpus_per_node)
    if cfg.layout == "colocated":
        return trainer
    per_node = gpus_per_node // cfg.rollout.tp_size
    if per_node == 0:
        raise ValueError(f"rollout.tp_size: {cfg.rollout.tp_size} GPUs per engine exceed the {gpus_per_node} GPUs "
                         "of a node; engines do not span nodes")
    return trainer + math.ceil(len(p.engines) / per_node)


def size_run(cfg: Config, hf: dict[str, Any], gpu: str, gpus_per_node: int = 8, nodes: int | None = None,
             master: str = "host", link: str | None = None, source: str = "") -> Plan:
    """The plan of `cfg` for the model of config.json `hf` on `gpu` (a key of `GPUS`): every section `qurl plan`
    prints (docs/plan.md). `master`: where the engines keep full-precision masters (the plugin's default: host).
    `link`: the push's link (default: CUDA IPC on the same GPU when colocated, NVLink when disaggregated on one
    node, InfiniBand across nodes). Raises ValueError naming a bad value."""
    g = get_gpu(gpu)
    if master not in ("host", "device"):
        raise ValueError(f"master {master!r}: use host (the plugin's default) or device")
    if link is not None and link not in LINK_NAMES:
        raise ValueError(f"unknown link {link!r}; use one of {list(LINK_NAMES)}")
    s = shape(hf)
    if s.experts and s.experts % cfg.train.ep_size:
        raise ValueError(f"train.ep_size: {cfg.train.ep_size} must divide the model's {s.experts} experts")
    needed = _nodes_needed(cfg, gpus_per_node)
    budget = _budget(s, cfg, g, master)
    verdict, problems = _verdict(s, cfg, g, master, gpus_per_node, budget)
    if nodes is not None and nodes < needed:
        problems.append(f"--nodes {nodes}: the layout needs {needed} node(s) of {gpus_per_node} GPUs; lower "
                        "train.dp_size / rollout.engines or give more nodes")
    precision, scope, fmt = cfg.resolved_precision()
    push = budget["push"]
    chosen = link or ("ipc" if cfg.layout == "colocated" else "nvlink" if needed == 1 else "infiniband")
    times = {name: push_seconds(push["bytes"], link_gb_s(name, g)) for name in LINK_NAMES}
    times["ipc"] = push_seconds(2 * push["bytes"], g.hbm_tb_s * 1000)  # the engine copies it in: read + write
    engine = budget["engine"]
    tp = cfg.rollout.tp_size
    engines_per_node = min(cfg.rollout.engines, gpus_per_node // tp)
    return Plan(
        model={"source": source, "model_type": s.model_type, "parameters": parameter_count(s),
               "layers": s.layers, "experts": s.experts},
        hardware={"gpu": g.name, "hbm_gib": g.hbm / GiB, "hbm_tb_s": g.hbm_tb_s, "bf16_tflops": g.tflops["bf16"],
                  "gpus_per_node": gpus_per_node, "nodes_needed": needed, "layout": cfg.layout,
                  "offload": budget["offload"]},
        trainer={**budget["trainer"], "peak_with_push": budget["trainer_peak"],
                 "split": {"tp": cfg.train.tp_size, "pp": cfg.train.pp_size, "ep": cfg.train.ep_size,
                           "dp": cfg.train.dp_size}},
        engines={**engine, "precision": precision.name, "scope": scope, "format": fmt, "tp": tp,
                 "count": cfg.rollout.engines, "host_masters_per_node": engine["host_masters"] * tp * engines_per_node},
        push={**push, "dtype": cfg.rollout.dtype, "link": chosen, "seconds": times[chosen], "seconds_by_link": times,
              "measured": {**MEASURED_PUSH, "this_model": s == shape(card(MEASURED_PUSH["model"]))}},
        rollout=rollout_ceiling(s, cfg, g, master, budget["beside"]),
        verdict=verdict, problems=problems)


def check_fits(cfg: Config, hf_config: dict[str, Any], gpu: str) -> list[str]:
    """The memory problems of `cfg` on `gpu` (a key of `GPUS`), each naming the lever that fixes it; empty when
    every GPU of the layout fits. For `preflight` on GPU targets: `problems += check_fits(cfg, hf, gpu)`."""
    return size_run(cfg, hf_config, gpu).problems
