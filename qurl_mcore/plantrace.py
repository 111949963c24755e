"""`qurl plan --trace`: the bytes a GPU would hold, measured by running the real code on fake CUDA devices
(`qurl_mcore.fakecuda`), beside the plan's figures (`qurl_mcore.sizing`).

Trainer: the rank of the fullest pipeline stage (the one `sizing.memory.trainer_bytes` plans) is built as
`loop.trainer.PolicyTrainer` builds it, at the model's full size from its config.json or architecture card (no
weights are read: a fake tensor has no values), and stepped twice, each of its optimizer steps (two at most of
`train.mini_batches`) on one micro-batch of `train.micro_batch_size` rows of `rollout.context_length` tokens on
every data-parallel rank (`_step`; an MoE's tokens routed as a balanced router routes them: `fakecuda._Tracer`).
Its peak is the most CUDA bytes alive at once over the build and the steps (forward, backward, Megatron's DDP
reduce, the optimizer's update: a traced step never reads a loss or a norm, so the update is always taken; the
first allocates the optimizer's states, which the second holds through its forward and backward, as every step of a
run after its first), then a push's export: every HF tensor gathered from its shards, cast to rollout.dtype and
bucketed as `loop.trainer.PolicyTrainer.weight_stream` gives it, and broadcast over the NCCL-like group as a
disaggregated push sends it.

Each trace runs in a fresh process (`fakecuda.run_traced`). docs/plan.md says which terms of the plan the
trace checks and which it cannot.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .config import Config
from .fakecuda import fake_cuda, run_traced
from .models.registry import shape
from .sizing import engine_bytes, hf_tensors, push_bytes, trainer_bytes
from .sizing.gpus import get_gpu
from .sizing.verdict import export_bytes

#: a traced peak further than this from the plan's is a disagreement (`qurl plan --trace` says so)
TOLERANCE = 0.15
#: a pipeline stage with more layers than this is traced with fewer, of each kind it holds (dense, moe): 1 of each,
#: then one more of each kind in turn, and each phase's peak extrapolated to the stage's layers (every term the plan
#: has is linear in the layers of each kind)
MAX_TRACED_LAYERS = 8
#: `qurl plan --gpu` names -> the façade's GPUs (`fakecuda.GPUS`)
_FAKE_GPU = {"h100-80g": "H100-80GB", "h200-141g": "H200", "b200-180g": "B200"}
_PLAN_GPU = {v: k for k, v in _FAKE_GPU.items()}
#: the phases of a step whose peaks are measured apart (in this order)
PHASES = ("build", "before_training", "forward_backward", "optimizer", "update_capture", "push")
#: the kinds of decoder layer a stage holds, as `traced_layers` names them
KINDS = ("dense", "moe")
#: packages SGLang requires (its own dependencies) that its CUDA branches import while building a model, by
#: top-level module: the CPU environment installs SGLang without them (requirements/sglang-cpu.txt)
GPU_PACKAGES = {"cuda": "cuda-python", "cutlass": "nvidia-cutlass-dsl[cu13]"}


def stage_layers(s, cfg: Config, stage: int) -> dict[str, int]:
    """The layers of each kind (`KINDS`) on pipeline stage `stage`: the model's dense prefix
    (`first_k_dense_replace`; every layer of a dense model) falls on the first stages."""
    per = s.layers // cfg.train.pp_size
    dense = min(per, max(0, s.dense_layers - stage * per)) if s.experts else per
    return {"dense": dense, "moe": per - dense}


def traced_models(layers: dict[str, int]) -> list[dict[str, int]]:
    """The layer counts of the fullest stage to trace: all of them when there are at most `MAX_TRACED_LAYERS`, else
    one of each kind present, then that plus one more of each kind in turn."""
    if sum(layers.values()) <= MAX_TRACED_LAYERS:
        return [layers]
    base = {k: min(n, 1) for k, n in layers.items()}
    return [base] + [{**base, kind: 2} for kind, n in layers.items() if n]


def per_layer(runs: list[dict[str, int]], models: list[dict[str, int]]) -> dict[str, dict[str, int]]:
    """What one more layer of each kind adds to each measured figure, from traces of the `models` layer counts
    (`traced_models`): f(base + 1 of kind) − f(base), 0 for a kind no traced model adds."""
    (base, *steps), (first, *others) = runs, models
    return {key: {kind: next((run[key] - base[key] for run, model in zip(steps, others)
                              if model[kind] != first[kind]), 0) for kind in KINDS} for key in base}


def extrapolate(runs: list[dict[str, int]], models: list[dict[str, int]], layers: dict[str, int]) -> dict[str, int]:
    """Each measured figure at the stage's `layers`, from traces of the `models` layer counts (`traced_models`):
    f(layers) = f(base) + Σ_kind (layers[kind] − base[kind])·(f(base + 1 of kind) − f(base))."""
    base, first = runs[0], models[0]
    return {key: base[key] + sum((layers[kind] - first[kind]) * step for kind, step in steps.items())
            for key, steps in per_layer(runs, models).items()}


def trace_trainer(cfg: Config, hf: dict[str, Any], gpu: str = "H100-80GB", timeout: float = 900.0) -> dict[str, Any]:
    """The traced trainer rank of `cfg` for the model of config.json `hf` (module docstring), beside the plan:
    `measured_peak_bytes` and `planned_peak_bytes` (the plan's peak with a push's export, `peak_with_push`),
    the peak of each phase (`phases`: the states after the build, what runs before training (no-grad log-prob
    passes, the update-capture metric's copy), the forward and backward, the optimizer's update, the
    update-capture metric after it, a push's export), the stage's layers of each kind (`stage_layers`) and those
    traced (`traced_layers`: one entry per traced model), the host synchronizations of one step (`host_syncs`,
    extrapolated like the peaks; `host_syncs_per_layer`, what one more layer of each kind adds, 0 where the stage
    was traced whole; `host_sync_sites` of the largest traced model), and the seconds the trace took."""

    s = shape(hf)
    plan = trainer_bytes(s, cfg)
    t = cfg.train
    world = t.tp_size * t.pp_size * t.dp_size
    # the first rank of the fullest stage: Megatron's rank order puts the pipeline stage outermost
    rank = plan["stage"] * (world // t.pp_size)
    layers = stage_layers(s, cfg, plan["stage"])
    models = traced_models(layers)
    start = time.perf_counter()
    runs = [run_traced(_trainer_step, cfg, _with_layers(hf, s, cfg, plan["stage"], model), rank, world, gpu,
                       timeout=timeout) for model in models]
    sites = runs[-1].pop("host_sync_sites")
    for run in runs[:-1]:
        run.pop("host_sync_sites")
    measured = extrapolate(runs, models, layers)
    syncs_per_layer = per_layer(runs, models)["host_syncs"]  # the MoE dispatcher's, per forward pass
    if len(models) > 1:  # but the push's: the states it starts from grow with the layers, its gathered tensor
        # and bucket do not
        measured["push"] = measured["push_start"] + max(r["push"] - r["push_start"] for r in runs)
    measured.pop("push_start")
    syncs = measured.pop("host_syncs")
    phases = {k: measured[k] for k in PHASES}
    out = {"measured_peak_bytes": max(phases.values()), "planned_peak_bytes": max(plan["peak"], export_bytes(
        cfg, plan, push_bytes(s, cfg))), "phases": phases,
           "planned": {"static": plan["static"], "activations": plan["activations"][t.recompute],
                       "update_capture": plan["update_capture"], "push": export_bytes(cfg, plan, push_bytes(s, cfg))},
           "rank": rank, "world_size": world, "stage_layers": layers,
           "traced_layers": {k: max(m[k] for m in models) for k in KINDS}, "traced_models": models,
           "host_syncs": syncs, "host_syncs_per_layer": syncs_per_layer, "host_sync_sites": sites}
    return {**out, "seconds": round(time.perf_counter() - start, 1)}


def _with_layers(hf: dict[str, Any], s, cfg: Config, stage: int, model: dict[str, int]) -> dict[str, Any]:
    """config.json `hf` cut to `model`'s layers on every pipeline stage, stage `stage`'s dense ones first."""
    n = sum(model.values())
    out = {**hf, "num_hidden_layers": n * cfg.train.pp_size}
    if s.experts and "first_k_dense_replace" in hf:
        out["first_k_dense_replace"] = stage * n + model["dense"] if model["dense"] else 0
    return out


def _trainer_step(cfg: Config, hf: dict[str, Any], rank: int, world: int, gpu: str) -> dict[str, Any]:
    """In the traced process: build the trainer rank, step it once and export a push (`trace_trainer`); the peak
    CUDA bytes of each of `PHASES`, and the host synchronizations of the step (count and sites)."""
    # Megatron-Core, in the traced process only
    import qurl_mcore.megatron as megatron
    import qurl_mcore.megatron.training as training
    from qurl_mcore.loop.trainer import PolicyTrainer

    peaks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        cfg = copy.deepcopy(cfg)
        cfg.model.path = tmp
        # an optimizer step's bytes do not depend on how many a batch takes: two show the second's (`_step`)
        cfg.train.mini_batches = min(cfg.train.mini_batches, 2)
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

            _uniform_pipeline_shapes()
            training.forward_backward = phase("forward_backward", training.forward_backward)
            # a traced loss and norm have no values (they read 1): take the update, as a finite step does
            take = phase("optimizer", training.step)
            training.step = lambda stack, clip_grad, skip=False: take(stack, clip_grad, False)
            trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world)
            # the states after the build (its passing copies, one tensor's at a time, do not grow with the layers
            # as the states do: a peak of 1 or 2 layers does not extrapolate)
            peaks["build"] = torch.cuda.memory_allocated()
            trace.reset_peak()
            # two steps, each phase's peak the larger: the first allocates the optimizer's states, which every
            # later step holds through its forward and backward; the synchronizations are the second's
            _step(trainer, cfg)
            mark("update_capture")
            before, sites = trace.host_syncs, copy.copy(trace.sync_sites)
            _step(trainer, cfg)
            peaks["host_syncs"] = trace.host_syncs - before
            peaks["host_sync_sites"] = dict(trace.sync_sites - sites)
            mark("update_capture")
            peaks["push_start"] = torch.cuda.memory_allocated()  # what the push starts from (trace_trainer)
            _push(trainer)
            mark("push")
            trainer.close()
    return peaks


def _uniform_pipeline_shapes() -> None:
    """Pipeline stages exchange each micro-batch's activation shape (`variable_seq_lengths`) as tensors, whose
    values a trace does not have: every micro-batch of the traced step has the shape the schedule computes from
    its sequence length and micro-batch size, so the traced stages take that one."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicate = P2PCommunicator._communicate

    def uniform(self, *args, **kwargs):
        saved, self.config.variable_seq_lengths = self.config.variable_seq_lengths, False
        try:
            return communicate(self, *args, **kwargs)
        finally:
            self.config.variable_seq_lengths = saved

    P2PCommunicator._communicate = uniform


def _step(trainer, cfg: Config) -> None:
    """One step on `train.micro_batch_size` rows of `rollout.context_length` tokens per data-parallel rank and
    mini-batch: each optimizer step's forward and backward holds a whole micro-batch, as in a run (fewer rows
    would split a micro-batch among the mini-batches)."""
    from qurl_mcore.loop.batch import TrainBatch

    t = cfg.train
    rows, width = t.micro_batch_size * t.mini_batches * t.dp_size, cfg.rollout.context_length
    ones = torch.ones(rows, width, dtype=torch.bool)
    batch = TrainBatch(torch.zeros(rows, width, dtype=torch.long), ones, ones.clone(), torch.zeros(rows, width),
                       torch.zeros(rows))
    trainer.step(batch)  # after the optimizer's phase: the update-capture metric


def _push(trainer) -> None:
    """A push's export (unsmoothed: rollout.smoothing's fold, one tensor at a time in fp32, is not traced), bucket
    by bucket; in the disaggregated layout broadcast over the default group as rank 0 sends it (a byte buffer a
    bucket, `WeightSender.send`), while a colocated push hands the buckets' own tensors to its engine."""
    from qurl_mcore.rollout.broadcast import WeightSender

    disaggregated = trainer.cfg.layout == "disaggregated"
    sender = WeightSender(None, "qurl-trace", "nccl", torch.distributed.get_world_size()) if disaggregated else None
    with trainer.weight_stream() as stream:
        for bucket in stream:
            if sender is not None:
                sender.send(bucket)


def engine_layers(s) -> dict[str, int]:
    """The decoder layers of each kind (`KINDS`) an engine holds: all of the model's (an engine has no pipeline
    stages), its dense prefix (`first_k_dense_replace`; every layer of a dense model) first."""
    dense = min(s.layers, s.dense_layers) if s.experts else s.layers
    return {"dense": dense, "moe": s.layers - dense}


def trace_engine(cfg: Config, hf: dict[str, Any], gpu: str = "H100-80GB", timeout: float = 1800.0) -> dict[str, Any]:
    """One engine GPU traced through SGLang's own code: the model class SGLang's loader picks for the
    architecture (`get_model_architecture`, with the plugin's hooks) built as TP rank 0 of `rollout.tp_size`
    (SGLang's parallel state over the fake group of that many ranks) with the server arguments a run's engine
    gets (`loop.sampler.engine_config`), its layers cut to one of each kind the model has (dense, moe);
    loaded by SGLang's `DefaultModelLoader.load_model` (the checkpoint's tensors fed in rollout.dtype, without
    values, on the host as SGLang reads them), then pushed once as a bf16 push runs
    (`restore_weights_before_loading`, the model's `load_weights`, `postprocess_weights`). What is measured are
    the CUDA storages that exist (the façade's `memory_allocated` and peak), each decoder layer's the storages
    reachable from its module (parameters, buffers and tensor attributes: the plugin's codes, SGLang's MLA
    decode weights); the model's other layers add their kind's:
      weights  after the load:  allocated + Σ_kind (layers − traced)·(a layer of the kind, quantized)
      load     its peak:        peak + Σ_kind (layers − traced)·(a layer of the kind before quantization:
                                SGLang builds the model in rollout.dtype and quantizes after loading it, but
                                the routed experts, which the plugin quantizes as they load)
      push     its peak:        weights + what one push adds at its peak above the weights (one module's
                                masters on the GPU at a time: it does not grow with the layers); a bf16
                                push only: engines that take code pushes (`Config.push_mode`) are not pushed
    `measured_peak_bytes` is the larger of load and push, beside the plan's (`engine_bytes(...)["load"]`);
    `measured_weight_bytes` beside `planned_weight_bytes` (the plan's `gpu_weights`); `host_syncs` those of the
    traced load and push. Where SGLang's class cannot be built on the façade, `not_built` says why and nothing
    is measured: Qwen2's MLP on CUDA imports SGLang's CuTe DSL dual GEMM whatever its quantization (SGLang has no
    switch for it), which needs `GPU_PACKAGES`; with them installed it is built and traced. Not traced:
    the KV cache and SGLang's reserve (the model runner, its attention backend and CUDA graphs do not start on the
    façade: docs/plan.md), and SGLang's custom all-reduce and message-queue broadcaster (no NVML, no peer
    processes)."""

    s = shape(hf)
    plan = engine_bytes(s, cfg, get_gpu(_PLAN_GPU.get(gpu, gpu)))
    layers = engine_layers(s)
    traced = {k: min(n, 1) for k, n in layers.items()}
    start = time.perf_counter()
    out = run_traced(_engine_step, cfg, _engine_hf(hf, s, traced), traced, gpu, timeout=timeout)
    if "not_built" in out:
        return {"not_built": out["not_built"], "planned_peak_bytes": plan["load"],
                "planned_weight_bytes": plan["weights"]["gpu_weights"], "tp_size": cfg.rollout.tp_size,
                "layers": layers, "traced_layers": dict.fromkeys(KINDS, 0), "host_syncs": 0,
                "seconds": round(time.perf_counter() - start, 1)}
    more = {k: layers[k] - traced[k] for k in KINDS}
    grow = lambda per: sum(more[k] * per[k] for k in KINDS)  # noqa: E731
    weights = out["weights"] + grow(out["layer_bytes"])
    load = out["load_peak"] + grow(out["loaded_layer_bytes"])
    push = weights + out["push_peak"] - out["weights"]
    return {"measured_peak_bytes": max(load, push), "planned_peak_bytes": plan["load"],
            "measured_weight_bytes": weights, "planned_weight_bytes": plan["weights"]["gpu_weights"],
            "phases": {"load": load, "push": push}, "model_class": out["model_class"],
            "tp_rank": 0, "tp_size": cfg.rollout.tp_size, "layers": layers, "traced_layers": traced,
            "layer_bytes": out["layer_bytes"], "loaded_layer_bytes": out["loaded_layer_bytes"],
            "host_syncs": out["host_syncs"], "not_traced": {"kv": plan["kv"], "reserve": plan["reserve"]},
            "seconds": round(time.perf_counter() - start, 1)}


def _engine_hf(hf: dict[str, Any], s, traced: dict[str, int]) -> dict[str, Any]:
    """config.json `hf` cut to the `traced` layers (dense first), with the `architectures` SGLang resolves its
    model class from (an architecture card has none: transformers' causal-LM class of its model_type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf["model_type"]]], **hf,
           "num_hidden_layers": sum(traced.values())}
    if s.experts and "first_k_dense_replace" in hf:
        out["first_k_dense_replace"] = traced["dense"]
    return out


def _engine_step(cfg: Config, hf: dict[str, Any], traced: dict[str, int], gpu: str) -> dict[str, Any]:
    """In the traced process: `trace_engine`'s build, load and push of TP rank 0, and what it measures."""
    tp = cfg.rollout.tp_size
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        with fake_cuda(devices=min(tp, 8), world_size=tp, rank=0, device=0, gpu=gpu) as trace:
            # SGLang, in the traced process and inside the façade only (its platform flags are read at import)
            from sglang.srt.model_loader.loader import DefaultModelLoader

            from qurl_mcore.loop.sampler import engine_config

            cuda = torch.device("cuda", 0)
            dtype = getattr(torch, cfg.rollout.dtype)
            checkpoint = [(x.name, x.shape) for x in hf_tensors(shape(hf))]

            def weights(device):  # the checkpoint (host tensors, as SGLang reads it), or a push (on the GPU)
                return ((name, torch.empty(size, dtype=dtype, device=device)) for name, size in checkpoint)

            def load_and_measure(model, feed, device):  # DefaultModelLoader.load_weights_and_postprocess
                DefaultModelLoader.load_weights_only(model, feed, device)
                out["loaded_layer_bytes"] = _per_kind(model, traced)
                DefaultModelLoader.postprocess_weights(model, device)

            with sglang_parallel(engine_config(cfg, cfg.recipe().engine, tmp, "cuda").engine_kwargs(), tp) as args:
                trace.reset_peak()
                synced = trace.host_syncs
                try:
                    model = load_sglang_model(args, lambda: weights("cpu"), load_and_measure)
                except ModuleNotFoundError as err:  # a CUDA branch's import of a package this environment lacks
                    package = GPU_PACKAGES.get((err.name or "").split(".")[0])
                    if package is None:
                        raise
                    return {"not_built": f"SGLang's {hf['architectures'][0]} on CUDA imports {err.name} (the "
                                         f"{package} package, which SGLang requires and this environment lacks; "
                                         f"it imports without a GPU) while it builds its layers"}
                out["load_peak"], out["weights"] = trace.peak_bytes, torch.cuda.memory_allocated()
                out["layer_bytes"] = _per_kind(model, traced)
                trace.reset_peak()
                if cfg.push_mode(shape(hf)) == "bf16":  # a code push carries the codes (sglang/weights.py)
                    push_sglang_model(model, weights(cuda))
                out["push_peak"] = trace.peak_bytes
                out["host_syncs"] = trace.host_syncs - synced
                out["model_class"] = type(model).__name__
                if torch.cuda.memory_allocated() != out["weights"]:
                    raise RuntimeError(f"a push left {torch.cuda.memory_allocated() - out['weights']} CUDA bytes "
                                       f"more than the load")
                del model
    return out


@contextlib.contextmanager
def sglang_parallel(engine_kwargs: dict[str, Any], tp: int) -> Iterator[Any]:
    """Inside `fake_cuda` (world size `tp`, rank 0): SGLang's runtime context and parallel state for TP rank 0
    of `tp`, as an engine's scheduler process sets them up from its server arguments (`engine_kwargs`,
    `rollout.EngineConfig.engine_kwargs`); yields the `ServerArgs`. The plugin is loaded as every SGLang
    process loads it. SGLang's shared-memory request broadcaster is off: no peer process reads it."""
    import os

    os.environ["SGLANG_USE_MESSAGE_QUEUE_BROADCASTER"] = "false"
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    args = ServerArgs(**engine_kwargs)
    with use_context(create_context(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))):
        init_distributed_environment(world_size=tp, rank=0, local_rank=0, backend="cuda:fake")
        initialize_model_parallel()
        yield args


def load_sglang_model(args, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], load=None):
    """SGLang's model for server arguments `args`, built and loaded on cuda:0 by SGLang's own
    `DefaultModelLoader.load_model` (the class `get_model_architecture` picks, the quantization config, the
    shared-expert decision), the checkpoint's tensors from `weights()` (host tensors, as SGLang reads a
    checkpoint: the GPU holds only what SGLang copies there); `load(model, weights, device)` in place of its
    `load_weights_and_postprocess`. The thread pools SGLang copies host tensors in (DeepSeek's loader) run their
    work inline: the façade's modes, which see every CUDA storage, are per thread."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig())
    loader._get_all_weights = lambda *_: weights()
    if load is not None:
        loader.load_weights_and_postprocess = load
    pools = concurrent.futures.ThreadPoolExecutor
    concurrent.futures.ThreadPoolExecutor = _InlineExecutor
    try:
        return loader.load_model(model_config=ModelConfig.from_server_args(args),
                                 device_config=DeviceConfig("cuda", 0))
    finally:
        concurrent.futures.ThreadPoolExecutor = pools


class _InlineExecutor(concurrent.futures.Executor):
    """A thread pool whose work runs in the submitting thread, at submission."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - the future carries it, as a pool's does
            future.set_exception(err)
        return future


def push_sglang_model(model, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """A bf16 push into SGLang's `model` on cuda:0, as SGLang runs one: `begin_weight_update` (the plugin's
    restore), the model's `load_weights` (`update_weights_from_*`), `end_weight_update` (re-quantization)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    cuda = torch.device("cuda", 0)
    DefaultModelLoader.restore_weights_before_loading(model, cuda)
    model.load_weights(weights)
    DefaultModelLoader.postprocess_weights(model, cuda)


def _per_kind(model: torch.nn.Module, traced: dict[str, int]) -> dict[str, int]:
    """CUDA bytes of the storages reachable from the first decoder layer of each kind of SGLang's `model`, whose
    layers are `traced` (dense first; `_storages`), but for those every layer shares: SGLang caches one rotary
    embedding per configuration (`get_rope`), whose cos/sin cache each layer's attention holds; 0 for a kind the
    model lacks."""
    from sglang.srt.layers.rotary_embedding.factory import _ROPE_DICT

    shared = {k for rope in _ROPE_DICT.values() for k in _storages(rope)}
    first = {"dense": 0, "moe": traced["dense"]}
    return {k: sum(n for key, n in _storages(model.model.layers[first[k]]).items() if key not in shared)
            if traced[k] else 0 for k in KINDS}


def _storages(module: torch.nn.Module) -> dict[int, int]:
    """The CUDA storages a module holds (storage -> bytes, each once): its parameters and buffers, and the
    tensors its submodules keep as attributes, alone or in lists, tuples, dicts and dataclasses (the plugin's
    codes and scales, SGLang's MLA decode weights)."""
    found: dict[int, int] = {}

    def visit(x, depth=0):
        if isinstance(x, torch.Tensor):
            if x.device.type == "cuda":
                found[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
        elif depth < 3 and isinstance(x, (list, tuple)):
            for y in x:
                visit(y, depth + 1)
        elif depth < 3 and isinstance(x, dict):
            for y in x.values():
                visit(y, depth + 1)
        elif depth < 3 and dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name), depth + 1)

    for m in module.modules():
        for x in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            visit(x)
    return found


def trace_plan(cfg: Config, hf: dict[str, Any], gpu: str = "h100-80g") -> dict[str, Any]:
    """What `qurl plan --trace` adds to the plan of `cfg` on `gpu` (a `qurl plan --gpu` name): the traced
    trainer rank (`trace_trainer`) and engine GPU (`trace_engine`), each with `measured_peak_bytes`,
    `planned_peak_bytes` and `agree` (within `TOLERANCE`)."""

    fake = _FAKE_GPU.get(get_gpu(gpu).name)
    if fake is None:
        raise ValueError(f"--gpu {gpu}: the trace pretends to be one of {sorted(_FAKE_GPU)}")
    out = {"trainer": trace_trainer(cfg, hf, fake), "engine": trace_engine(cfg, hf, fake)}
    for side in out.values():
        side["agree"] = None if "not_built" in side else \
            abs(side["measured_peak_bytes"] - side["planned_peak_bytes"]) <= TOLERANCE * side["planned_peak_bytes"]
    return out


def format_trace(trace: dict[str, Any]) -> str:
    """The lines `qurl plan --trace` prints after the plan."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    t, e = trace["trainer"], trace["engine"]
    kinds = lambda d: " + ".join(f"{n} {k}" for k, n in d.items() if n)  # noqa: E731
    models = t["traced_models"]
    how = (f"all {kinds(t['stage_layers'])} layers of its stage" if len(models) == 1 else
           f"{', '.join(kinds(m) for m in models)} layers per stage, each phase's peak extrapolated to the stage's "
           f"{kinds(t['stage_layers'])}")
    phases = ", ".join(f"{k} {gib(v)}" for k, v in t["phases"].items())
    layer_syncs = "".join(f", {n} per {kind} layer" for kind, n in t["host_syncs_per_layer"].items() if n)
    lines = [
        f"trace     trainer rank {t['rank']} of {t['world_size']} on fake CUDA ({how}; {t['seconds']:.0f} s): "
        f"measured peak {gib(t['measured_peak_bytes'])}, planned {gib(t['planned_peak_bytes'])} ({_diff(t)}); "
        f"per phase: {phases}; push's export planned {gib(t['planned']['push'])}; {t['host_syncs']} host "
        f"synchronizations a step{layer_syncs}",
        f"trace     engine not traced: {e['not_built']}" if "not_built" in e else
        f"trace     engine TP rank 0 of {e['tp_size']} through SGLang's {e['model_class']} on fake CUDA (built, "
        f"loaded and pushed once at {kinds(e['traced_layers'])} layers, each kind's storages extrapolated to "
        f"{kinds(e['layers'])}; {e['seconds']:.0f} s): measured peak {gib(e['measured_peak_bytes'])} (load "
        f"{gib(e['phases']['load'])}, push {gib(e['phases']['push'])}), planned {gib(e['planned_peak_bytes'])} "
        f"(the load's, {_diff(e)}); weights after the load {gib(e['measured_weight_bytes'])}, planned "
        f"{gib(e['planned_weight_bytes'])}; {e['host_syncs']} host synchronizations in the traced load and push; "
        f"KV cache and SGLang's reserve not traced",
    ]
    lines += [f"problem   trace: the {who}'s measured peak differs from the plan's by more than "
              f"{TOLERANCE:.0%}: the plan misses a term, or the trace one (docs/plan.md)"
              for who, side in trace.items() if side["agree"] is False]
    return "\n".join(lines)


def _diff(side: dict[str, Any]) -> str:
    planned = side["planned_peak_bytes"]
    return f"{(side['measured_peak_bytes'] - planned) / planned:+.1%}" if planned else "nothing planned"
