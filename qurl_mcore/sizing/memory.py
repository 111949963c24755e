"""The bytes of a run on each GPU: a trainer rank's (its states and the activations of a training step) and an
engine's (weights, full-precision masters, KV cache, SGLang's reserve).

Notation (the model's: `tensors`): TP/PP/EP/DP the trainer's split (expert tensor parallelism ETP = 1 when
EP > 1, else TP: `megatron.parallel.init_parallel`); s the sequence length (`rollout.context_length`, the longest
a padded micro-batch gets), b `train.micro_batch_size`.

Trainer, per GPU (the pipeline stage holding most), P the rank's parameters: dense parts /TP (norms and routers
replicated), embedding and lm_head /TP on the first and last stage, experts E/EP of them /ETP, layers /PP:
  params      P·p                    p = 2 (bf16, GPUs) or 4 (fp32, CPUs): `Config.train_dtype`
  reference   P·p                    only with train.kl_coef > 0 (a frozen copy)
  gradients   P·4                    Megatron DDP's fp32 buffer (grad_reduce_in_fp32; param.grad aliases it)
  main params P·4 / D                fp32 copies of bf16 parameters (none for fp32)
  Adam m, v   P·8 / D                D = 1, or with the distributed optimizer the data-parallel size
                                     (DP for dense parameters, TP·DP/(EP·ETP) for experts)
  activations `activation_bytes`     one micro-batch per pipeline stage in flight (1F1B)
  peak        states + the larger of the activations (with the update-capture metric's copy of the
              engine-quantized linears) and that metric's copies at the end of a step (`update_capture_bytes`)
Engines, per GPU of an engine with rollout.tp_size = t: the linears `precision.quantized_linears` names in the
precision's format (`quant.formats.FormatSpec.weight_bytes`), everything else in rollout.dtype, /t;
full-precision masters of the quantized linears (host RAM by default; they come back to the GPU during every
push); the load, every weight in rollout.dtype /t (SGLang quantizes after loading the whole model); the KV cache
2·L·g·d·2 bytes per token (g/t per GPU); SGLang's own reserve for activations and CUDA graphs
(`sglang_reserve`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..models.slots import Shape
from ..quant.formats import FORMATS
from .gpus import GPU, GiB
from .tensors import _DTYPE_BYTES, _REPLICATED, Tensor, _quantized, hf_tensors


# ---- trainer ----------------------------------------------------------------------------------------------

@dataclass
class _Stage:
    dense: int = 0  # parameters one rank of the stage holds outside the experts
    expert: int = 0
    trained_quantized: int = 0  # of those, in linears the trainer quantizes (precision.quantized_linears, train)
    stacked_experts: int = 0  # routed experts' parameters the trainer keeps in full precision, which grouped experts
    # stack into one tensor per projection for their GEMMs (`megatron.grouped_experts`)
    layers: int = 0
    dense_layers: int = 0  # of those, dense layers before the MoE ones (DeepSeek-V3's, GLM-4.5's first_k_dense_replace)


def _stages(s: Shape, cfg: Config) -> list[_Stage]:
    """The parameters of one rank of each pipeline stage."""
    t = cfg.train
    tp, pp, ep = t.tp_size, t.pp_size, t.ep_size
    etp = 1 if ep > 1 else tp
    per = s.layers // pp
    quantized = _quantized(s, cfg.precision, cfg.scope, "train")
    stages = [_Stage(layers=per, dense_layers=min(per, max(0, s.dense_layers - k * per))) for k in range(pp)]
    experts = [[0, 0] for _ in range(pp)]  # all experts' parameters, of them quantized, per stage
    tensors = list(hf_tensors(s, pp))
    if s.tied and pp > 1:  # the last stage keeps a copy of the embedding as its output layer
        tensors.append(Tensor("output_layer (tied copy)", (s.vocab, s.hidden), None, "output"))
    for x in tensors:
        k = (0 if x.kind == "embedding" else pp - 1) if x.layer is None else x.layer // per
        if x.kind == "experts":
            experts[k][0] += x.numel
            experts[k][1] += x.numel if x.name in quantized else 0
            continue
        n = x.numel if x.kind in _REPLICATED else math.ceil(x.numel / tp)
        stages[k].dense += n
        stages[k].trained_quantized += n if x.name in quantized else 0
    for st, (n, q) in zip(stages, experts):  # a rank holds E/EP experts, each /ETP
        st.expert += n // (ep * etp)
        st.trained_quantized += q // (ep * etp)
        st.stacked_experts += (n - q) // (ep * etp)
    return stages


def _microbatches(cfg: Config) -> int:
    """Micro-batches per optimizer step on one data-parallel rank."""
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    return max(1, math.ceil(rows / (cfg.train.dp_size * cfg.train.mini_batches * cfg.train.micro_batch_size)))


RECOMPUTE_ORDER = ("none", "selective", "full")


def layer_activation_bytes(s: Shape, cfg: Config, e: int = 2) -> dict[str, int]:
    """What one decoder layer keeps for its backward, per token on one rank before /TP, in bytes: the tensors
    the autograd graph of our Megatron layer (local spec, SDPA core attention, torch norms, no fusions) saves,
    counted as measured on it (tests/test_plan.py; docs/plan.md). e bytes per element, x = e, or 4 for the
    inputs of linears the trainer quantizes (its autograd keeps them dequantized, fp32).
      norm        2e·h + 4        input, its normalised copy (before ·γ) and 1/rms (fp32), each of the two
      attention   norm + x·h (QKV input) + e·a·d (q after RoPE) + x·a·d (linear_proj input, which SDPA also keeps
                  as its output) [+ e·(3a+3g)·d with q/k norms: their inputs, outputs and the QKV output]
      core        e·s (SDPA's additive mask, b·s² per micro-batch) + 4a (log-sum-exp)
                  + 2e·a·d (k, v repeated to a heads) or, without grouping, e·a·d + e·(a+2g)·d (k after
                  RoPE; v, a view of the QKV output)
      selective   core recomputed: the checkpoint keeps its inputs instead, k (e·g·d) and v (the QKV output,
                  e·(a+2g)·d, unless q/k norms keep it already)
      MLA         attention: norm + e·h (the down projections' input; they stay full precision) + 2e·r_q + 4
                  (q's norm) + x·r_q (q_up input) + e·(r_kv + d_r) + 4 + e·r_kv (kv's norm, its input a view of
                  the kv down projection's output) + x·r_kv (kv_up input) + e·a·d (q with its RoPE part, d =
                  d_nope + d_r) + x·a·d_v (linear_proj input); core: e·s + 4a + e·a·d (k) + e·a·d_v (v);
                  selective: k and v
      dense MLP   norm + x·h (fc1 input) + 4e·i (fc1 output [gate; up], silu(gate), up + 0 in Megatron's glu)
                  + x·i (fc2 input)
      MoE         norm + e·h (router input) + 5E + 24k (router scores, probabilities, top-k maps)
                  + k·(x·h + 5e·i_m + 4 + x·i_m) per routed copy: expert fc1 input, fc1 output, silu, up + 0,
                  the product scaled by its routing probability (and that probability), fc2 input
                  [+ 4e·i_s + x·i_s, a shared expert] [+ e·(h + 1), its sigmoid gate: the expert's output and
                  the gate's value]
      (`mlp` is the MoE's in an MoE model; `dense_mlp` the dense MLP of its first dense layers)
    For GPT's layer (MHA, a 4h GeLU MLP, dropout, fused norms) the same accounting gives Korthikanti et al.'s
    s·b·h·(34 + 5·a·s/h) (Reducing Activation Recomputation in Large Transformer Models, §4); SDPA keeps no
    a·s² scores and RL training has no dropout."""
    h, a, g, d, sq = s.hidden, s.heads, s.kv_heads, s.head_dim, cfg.rollout.context_length
    quantized = {x.kind for x in hf_tensors(s) if x.name in _quantized(s, cfg.precision, cfg.scope, "train")}
    x = {grp: (4 if grp in quantized else e) for grp in ("attention", "mlp", "experts", "shared_experts")}
    norm = 2 * e * h + 4
    qkv_out = e * (a + 2 * g) * d
    attention = norm + x["attention"] * h + e * a * d + x["attention"] * a * d
    attention += e * (3 * a + 3 * g) * d if s.qk_norm else 0
    core = e * sq + 4 * a + (2 * e * a * d if g < a else e * a * d + qkv_out)
    selective = e * g * d + (0 if s.qk_norm else qkv_out)
    if "mla" in s.features:
        ql, kl, dr, dv = s.q_lora_rank, s.kv_lora_rank, s.qk_rope_head_dim, s.v_head_dim
        attention = (norm + e * h + 2 * e * ql + 4 + x["attention"] * ql + e * (kl + dr) + 4 + e * kl
                     + x["attention"] * kl + e * a * d + x["attention"] * a * dv)
        core = e * sq + 4 * a + e * a * d + e * a * dv
        selective = e * a * d + e * a * dv
    if s.experts:
        im, xe = s.moe_intermediate, x["experts"]
        mlp = norm + e * h + 5 * s.experts + 24 * s.topk + s.topk * (xe * h + 5 * e * im + 4 + xe * im)
        if s.shared_intermediate:
            mlp += 4 * e * s.shared_intermediate + x["shared_experts"] * s.shared_intermediate
        if "shared_expert_gate" in s.features:
            mlp += e * (h + 1)
    dense = norm + x["mlp"] * h + 4 * e * s.intermediate + x["mlp"] * s.intermediate
    return {"attention": attention, "core": core, "selective": selective, "mlp": mlp if s.experts else dense,
            "dense_mlp": dense}


def rope_bytes(s: Shape, sq: int, e: int = 2) -> int:
    """RoPE's cos and sin for q and k that a layer keeps, for sequences of sq tokens: 4·e·d·sq, d the rotary
    head dimension (MLA's d_r)."""
    return 4 * e * (s.qk_rope_head_dim if "mla" in s.features else s.head_dim) * sq


def activation_bytes(s: Shape, cfg: Config, recompute: str, e: int = 2) -> list[int]:
    """Activation bytes of the training step on one rank of each pipeline stage, e bytes per element, at its
    peak: the end of the forward, when every layer's saved tensors (`layer_activation_bytes`) and the logits
    are alive. With sequence parallelism all of it /TP, per layer and micro-batch of b sequences of s:
      none        b·s·(attention + core + mlp)/TP + 4·e·d·s (RoPE's cos and sin for q and k; d_r with MLA)
      selective   the same with `selective` in place of `core`
      full        e·h·s·b/TP (the checkpointed layer input) plus one layer's whole set, recomputed
    Times the micro-batches in flight on the stage (1F1B: PP − stage, at most the micro-batches of a step).
    Plus, on the last stage, the logits s·b·V/TP·(e + 4 + 4) (the model's output, its fp32 copy / temperature,
    and the contiguous copy vocab_parallel_cross_entropy exponentiates and keeps: megatron/logprobs.py), the
    fp32 weights each quantized linear keeps for its backward (quantized-training precisions), and the stacked
    weights of grouped experts in full precision, e bytes per element (the trainer's experts module for every
    precision but per-tensor FP8 on TE, `stack.experts`, whose experts are quantized): all of the stage's, or one
    layer's under full recompute.
    """
    if recompute not in RECOMPUTE_ORDER:
        raise ValueError(f"train.recompute: {recompute!r} is not one of {list(RECOMPUTE_ORDER)}")
    t = cfg.train
    sq = cfg.rollout.context_length
    tokens = sq * t.micro_batch_size
    per = layer_activation_bytes(s, cfg, e)
    rope = rope_bytes(s, sq, e)

    def layer(core: str, mlp: str) -> int:
        return tokens * (per["attention"] + per[core] + per[mlp]) // t.tp_size + rope

    out = []
    for k, st in enumerate(_stages(s, cfg)):
        inflight = min(t.pp_size - k, _microbatches(cfg))
        moe = st.layers - st.dense_layers
        if recompute == "full":  # the recomputed layer: the larger kind the stage has
            layers = st.layers * tokens * e * s.hidden // t.tp_size + max(
                layer("core", "mlp") if moe else 0, layer("core", "dense_mlp") if st.dense_layers else 0)
        else:
            core = "core" if recompute == "none" else "selective"
            layers = moe * layer(core, "mlp") + st.dense_layers * layer(core, "dense_mlp")
        weights = (4 * st.trained_quantized + e * st.stacked_experts) // (st.layers if recompute == "full" else 1)
        logits = tokens * math.ceil(s.vocab / t.tp_size) * (e + 8) if k == t.pp_size - 1 else 0
        out.append(inflight * (layers + weights) + logits)
    return out


def update_capture_bytes(s: Shape, cfg: Config, e: int = 2) -> list[dict[str, int]]:
    """Bytes the update-capture metric (`uaq/update_capture`, on while the engines quantize and
    `logging.update_capture` is true) adds on one rank of each pipeline stage: `during` the step, this rank's
    shards of the linears the engines quantize, copied before the forward (Q·e; dense linears /TP, experts
    /(EP·ETP)); at the `end`, after the update (the activations gone, the states kept), that copy, a second one
    and, while the codes of one tensor are compared, its fp32 copy and quotient and both codes (2·Q·e + 10 bytes
    per element of the largest shard)."""
    t = cfg.train
    none = [{"during": 0, "end": 0} for _ in range(t.pp_size)]
    if not cfg.logging.update_capture:
        return none
    precision, scope, _ = cfg.resolved_precision()
    names = _quantized(s, precision.name, scope, "rollout")
    if not names:
        return none
    etp = 1 if t.ep_size > 1 else t.tp_size
    per = s.layers // t.pp_size
    total, largest = [0] * t.pp_size, [0] * t.pp_size
    for x in hf_tensors(s):
        if x.name not in names or x.layer is None:
            continue
        k = x.layer // per
        n = x.numel // (t.ep_size * etp) if x.kind == "experts" else math.ceil(x.numel / t.tp_size)
        total[k] += n
        largest[k] = max(largest[k], n)
    return [{"during": e * q, "end": 2 * e * q + 10 * m} for q, m in zip(total, largest)]


def trainer_bytes(s: Shape, cfg: Config, cuda: bool = True) -> dict[str, Any]:
    """The trainer's bytes per GPU on its fullest pipeline stage (module docstring): each state with and without
    the distributed optimizer, the activations for each recompute choice, and `peak` for the config's choices.
    `cuda`: the defaults of a GPU run (bf16, distributed optimizer) or of a CPU one (fp32, none)."""
    t = cfg.train
    p = cfg.train_dtype(cuda).itemsize
    distributed = cfg.distributed_optimizer(cuda)
    etp = 1 if t.ep_size > 1 else t.tp_size
    dense_dp, expert_dp = t.dp_size, t.tp_size * t.dp_size // (t.ep_size * etp)
    main = 4 if p == 2 else 0
    acts = {r: activation_bytes(s, cfg, r, p) for r in RECOMPUTE_ORDER}
    capture = update_capture_bytes(s, cfg, p)
    per_stage = []
    for k, st in enumerate(_stages(s, cfg)):
        n = st.dense + st.expert
        states = {
            "params": n * p, "reference": n * p if t.kl_coef > 0 else 0, "gradients": n * 4,
            "main_params": {"replicated": n * main, "distributed": main * st.dense // dense_dp
                            + main * st.expert // expert_dp},
            "optimizer": {"replicated": n * 8, "distributed": 8 * st.dense // dense_dp + 8 * st.expert // expert_dp},
        }
        which = "distributed" if distributed else "replicated"
        static = sum(v[which] if isinstance(v, dict) else v for v in states.values())
        stage_acts = {r: v[k] for r, v in acts.items()}
        per_stage.append({"stage": k, "parameters": n, **states, "activations": stage_acts, "static": static,
                          "update_capture": capture[k],
                          "peak": static + max(stage_acts[t.recompute] + capture[k]["during"], capture[k]["end"])})
    worst = max(per_stage, key=lambda x: x["peak"])
    return {**worst, "dtype": "bf16" if p == 2 else "fp32", "distributed_optimizer": distributed,
            "recompute": t.recompute, "microbatches_per_step": _microbatches(cfg)}


def batch_bytes(s: Shape, cfg: Config) -> int:
    """Host bytes of one step's batch on a trainer rank, N = data.prompts_per_step·rollout.samples_per_prompt
    samples padded to at most s = rollout.context_length tokens: every rank holds the whole batch, 14 bytes a
    token (token ids 8, the attention and response masks 1 each, behaviour log-probs 4) [+ 2·L·k with routing
    replay: the engine's expert ids, int16], and its own N/DP rows' π_prox (train.mini_batches > 1) and π_ref
    (train.kl_coef > 0) log-probs, 4 bytes a token each."""
    t = cfg.train
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    tokens = rows * cfg.rollout.context_length
    per_token = 14 + (2 * s.layers * s.topk if s.experts and t.routing_replay == "r3" else 0)
    own = 4 * ((t.mini_batches > 1) + (t.kl_coef > 0))
    return tokens * per_token + math.ceil(rows / t.dp_size) * cfg.rollout.context_length * own


# ---- engines ----------------------------------------------------------------------------------------------

_PREFILL_GRAPH_SIZES = (*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                        *range(1280, 4097, 256))


def sglang_reserve(gpu: GPU, tp: int) -> tuple[int, int]:
    """(reserve, its CUDA-graph part) in bytes: what SGLang 0.5.23 keeps out of weights + KV cache per GPU
    (mem_fraction_static = 1 − reserve/HBM; sglang/srt/arg_groups/memory_hook.py), in MiB:
      max(512 + 1.5·chunk + 1024·TP/8 + 2·decode_bs + 8·prefill_graphs, 10240)
    chunk = chunked_prefill_size, decode_bs = the decode CUDA graphs' largest batch (512 at TP ≥ 4), and
    prefill_graphs the number of captured prefill sizes up to chunk."""
    decode_bs = gpu.sglang_decode_bs if tp < 4 else 512
    prefill = len([x for x in _PREFILL_GRAPH_SIZES if x <= gpu.sglang_chunk]) + len(
        range(4608, gpu.sglang_chunk + 1, 512))
    graphs = 2 * decode_bs + 8 * prefill
    reserve = max(512 + 1.5 * gpu.sglang_chunk + 1024 * tp / 8 + graphs, 10240)
    return int(reserve * 2**20), graphs * 2**20


def engine_weights(s: Shape, precision: str, scope: str, fmt: str | None, dtype: str, tp: int = 1) -> dict[str, int]:
    """Bytes of one engine's weights: over the whole engine, `quantized` (the linears the precision quantizes,
    in `fmt`), `full` (everything else, in `dtype`), `masters` (the quantized linears in `dtype`, which the
    plugin keeps besides), `experts` and `embedding` (parts of those), `expert_masters` (the part of `masters`
    that is routed experts); per GPU of its `tp`, `gpu_weights` (all but the replicated norms and routers /TP),
    `gpu_masters`, and `gpu_load`: what the GPU holds at the end of SGLang's load, which builds the model in
    `dtype` (`DefaultModelLoader.load_model`) and quantizes its linears after loading them, but for quantized
    experts, which the plugin quantizes as each piece loads (sglang/moe.py): the other weights in `dtype`, the
    experts' codes, and what waits to be quantized, at most one layer's experts' gate and up in `dtype` (NVFP4:
    a gate waits for its up, whose rows its global scale spans; other formats: one expert's, a piece at a time)."""
    names = _quantized(s, precision, scope, "rollout")
    b = _DTYPE_BYTES[dtype]
    out = dict.fromkeys(("quantized", "full", "masters", "experts", "embedding", "replicated", "expert_masters"), 0)
    waiting: dict[int | None, int] = {}  # layer -> its quantized experts in dtype
    for x in hf_tensors(s):
        n = FORMATS[fmt].weight_bytes(*x.shape) if x.name in names else x.bytes(b)
        out["quantized" if x.name in names else "full"] += n
        out["masters"] += x.numel * b if x.name in names else 0
        out["experts"] += n if x.kind == "experts" else 0
        out["embedding"] += n if x.kind == "embedding" else 0
        out["replicated"] += n if x.kind in _REPLICATED else 0
        if x.kind == "experts" and x.name in names:
            out["expert_masters"] += x.numel * b
            waiting[x.layer] = waiting.get(x.layer, 0) + x.numel * b
    sharded = out["quantized"] + out["full"] - out["replicated"]
    # what waits: a layer's experts' gate and up (two of an expert's three equal matrices), or one expert's
    waits = bool(waiting) and FORMATS[fmt].tensor_scale_bytes > 0
    staging = 2 * max(waiting.values(), default=0) // 3 // (1 if waits or not s.experts else s.experts)
    loaded = out["masters"] - out["expert_masters"] + out["full"] - out["replicated"] + \
        (out["experts"] if out["expert_masters"] else 0) + staging
    return {**out, "gpu_weights": sharded // tp + out["replicated"], "gpu_masters": out["masters"] // tp,
            "gpu_load": loaded // tp + out["replicated"]}


def engine_bytes(s: Shape, cfg: Config, gpu: GPU, master: str = "host", kv_tokens: int | None = None,
                 precision: str | None = None) -> dict[str, Any]:
    """One engine GPU: weights, masters, KV cache, SGLang's reserve, and the peak over rollout and pushes.

    KV tokens: `kv_tokens`, else rollout.max_total_tokens, else what rollout.mem_fraction leaves after the
    weights and CUDA graphs (mem_fraction·HBM − weights on the device − graphs: SGLang 0.5.23 keeps
    (1 − mem_fraction) of the memory free at its start and sizes the cache after capturing its graphs), else
    what SGLang sizes on a GPU of its own: HBM − reserve − weights on the device; each over the KV bytes per
    token per GPU. Peak:
      weights on the device + KV + reserve     (master=device: the masters are weights on the device; with
                                                master=host a push brings one matrix of them at a time to
                                                the GPU to re-quantize it, inside the reserve)
    `released`: what stays on the GPU after the engine gives its memory back (rollout.offload): the reserve
    less its CUDA graphs (SGLang's workspace, cached by torch's allocator outside the memory saver).
    `mem_fraction`: the rollout.mem_fraction that holds these weights, this KV cache and the graphs, with
    1 GiB to spare, rounded up to a hundredth; None when that is more than the whole GPU.
    `precision` None: the config's; "bf16" sizes the same engine unquantized. Engines that take code pushes
    (`Config.push_mode`) keep no masters: `master` is then "none"."""
    tp = cfg.rollout.tp_size
    master = "none" if cfg.push_mode(s) == "codes" else master
    row, scope, fmt = cfg.resolved_precision()
    w = engine_weights(s, precision or row.name, scope, fmt, cfg.rollout.dtype, tp)
    reserve, graphs = sglang_reserve(gpu, tp)
    w = {**w, "gpu_masters": 0} if master == "none" else w
    on_device = w["gpu_weights"] + (w["gpu_masters"] if master == "device" else 0)
    per_token = s.kv_bytes_per_token(_DTYPE_BYTES[cfg.rollout.dtype], tp)
    if kv_tokens is None:
        room = cfg.rollout.mem_fraction * gpu.hbm - graphs if cfg.rollout.mem_fraction else gpu.hbm - reserve
        kv_tokens = cfg.rollout.max_total_tokens or max(0, int(room - on_device) // per_token)
    kv = kv_tokens * per_token
    fraction = math.ceil(100 * (on_device + kv + graphs + GiB) / gpu.hbm) / 100
    load = w["gpu_load"] + (w["expert_masters"] // tp if master == "device" else 0)  # the masters load there
    return {"weights": w, "master": master, "load": load, "kv_bytes_per_token": per_token,
            "kv_tokens": kv_tokens, "kv": kv,
            "reserve": reserve, "cuda_graphs": graphs, "peak": on_device + kv + reserve,
            "released": reserve - graphs,
            "mem_fraction": fraction if fraction <= 1 else None,
            "host_masters": w["gpu_masters"] if master == "host" else 0}


def _kv_beside(s: Shape, cfg: Config, gpu: GPU, master: str, other: int, precision: str | None = None) -> int:
    """The KV tokens (a multiple of 1024) an engine GPU holds at its peak beside `other` bytes: as many as fit,
    at most enough for all of the engine's sequences of a step at rollout.context_length."""
    eng = engine_bytes(s, cfg, gpu, master, 0, precision)
    fit = max(0, (gpu.hbm - other - eng["peak"]) // eng["kv_bytes_per_token"]) // 1024 * 1024
    r = cfg.rollout
    wanted = math.ceil(cfg.data.prompts_per_step * r.samples_per_prompt / r.engines) * r.context_length
    return min(fit, -(-wanted // 1024) * 1024)
