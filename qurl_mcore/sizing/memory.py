"""`qurl plan`: the bytes of a run on each GPU, the weight push and the decode ceiling, before a GPU hour is
spent. Pure functions over a model shape (an HF config.json as a dict) and a `Config`; importing this module
imports neither torch nor Megatron nor SGLang (the trainer's dtype and optimizer defaults are `Config`'s, which
asks torch when called). docs/plan.md states every formula with its source and compares the numbers with
published ones.

Notation: h hidden, i intermediate (i_m per expert, i_s shared expert), L layers, a attention heads, g key-value
heads, d head dim, V vocabulary, E experts, k experts per token; TP/PP/EP/DP the trainer's split (expert tensor
parallelism ETP = 1 when EP > 1, else TP: `megatron.parallel.init_parallel`); s the sequence length
(`rollout.context_length`, the longest a padded micro-batch gets), b `train.micro_batch_size`.

Parameters, counted exactly from the shape (`hf_tensors`, in the order the weight push streams them):
embedding V·h, lm_head V·h (untied), per layer q h·a·d, k and v h·g·d each (+ a·d, g·d, g·d biases for Qwen2),
o a·d·h, q/k norms d each (Qwen3), two norms h, a dense SwiGLU MLP 3·h·i, or a router E·h and E experts of
3·h·i_m (+ a shared expert 3·h·i_s), and the final norm h.

Trainer, per GPU (the pipeline stage holding most), P the rank's parameters: dense parts /TP (norms and routers
replicated), embedding and lm_head /TP on the first and last stage, experts E/EP of them /ETP, layers /PP:
  params      P·p                    p = 2 (bf16, GPUs) or 4 (fp32, CPUs): `Config.train_dtype`
  reference   P·p                    only with train.kl_coef > 0 (a frozen copy)
  gradients   P·4                    Megatron DDP's fp32 buffer (grad_reduce_in_fp32; param.grad aliases it)
  main params P·4 / D                fp32 copies of bf16 parameters (none for fp32)
  Adam m, v   P·8 / D                D = 1, or with the distributed optimizer the data-parallel size
                                     (DP for dense parameters, TP·DP/(EP·ETP) for experts)
  activations `activation_bytes`     one micro-batch per pipeline stage in flight (1F1B)
Engines, per GPU of an engine with rollout.tp_size = t: the linears `precision.quantized_linears` names in the
precision's format (`WEIGHT_FORMATS`), everything else in rollout.dtype, /t; full-precision masters of the
quantized linears (host RAM by default; they come back to the GPU during every push); the KV cache
2·L·g·d·2 bytes per token (g/t per GPU); SGLang's own reserve for activations and CUDA graphs (`sglang_reserve`).
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..precision import num_experts, quantized_linears

GB = 10**9
GiB = 2**30


# ---- hardware ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """An accelerator: usable HBM (the spec sheet's decimal GB: the ~7% to the physical GiB covers the CUDA
    context, NCCL buffers and allocator fragmentation), its bandwidth, dense tensor-core TFLOP/s per format,
    NVLink per direction, and SGLang 0.5.23's defaults for its memory class (chunked_prefill_size, the decode
    CUDA-graph batch at engine TP < 4; sglang/srt/arg_groups/memory_hook.py)."""

    name: str
    hbm_gb: float
    hbm_tb_s: float
    tflops: dict[str, float]
    nvlink_gb_s: float
    sglang_chunk: int
    sglang_decode_bs: int

    @property
    def hbm(self) -> int:
        return int(self.hbm_gb * GB)

    def peak_tflops(self, fmt: str | None) -> float:
        """Dense tensor-core peak for GEMMs in `fmt` (None: bf16); a format without tensor cores runs at bf16's."""
        return self.tflops.get(fmt or "bf16", self.tflops["bf16"])


_HOPPER = {"bf16": 989.0, "int8": 1979.0, "fp8_e4m3": 1979.0}  # no FP4 tensor cores
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80g", 80, 3.35, _HOPPER, 450, 8192, 256),
    GPU("h200-141g", 141, 4.8, _HOPPER, 450, 8192, 256),
    GPU("b200-180g", 180, 8.0, {"bf16": 2250.0, "int8": 4500.0, "fp8_e4m3": 4500.0, "nvfp4": 9000.0,
                                "mxfp4": 9000.0}, 900, 16384, 512),
)}

#: links a weight push can cross, GB/s per direction ("nvlink" is the GPU's own, `GPU.nvlink_gb_s`)
LINKS: dict[str, float] = {
    "infiniband": 50.0,  # NDR, 400 Gb/s per GPU NIC
    "pcie": 64.0,  # Gen5 x16
}
LINK_NAMES = ("nvlink", *LINKS)


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; use one of {list(GPUS)}") from None


def local_gpu() -> str | None:
    """The `GPUS` key of this machine's first CUDA device, by its name (None: no GPU, or one not in the
    table)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).lower()
    return next((key for key in GPUS if key.split("-")[0] in name), None)


def link_gb_s(link: str, gpu: GPU) -> float:
    if link == "nvlink":
        return gpu.nvlink_gb_s
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; use one of {list(LINK_NAMES)}")
    return LINKS[link]


# ---- quantized weight formats ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """Bytes of a quantized [rows, cols] weight: `bits` per element, a `block_scale` byte per `block` elements
    of a row, `row_scale` bytes per row, `tensor_scale` bytes per tensor (`qurl_mcore.quant.quantize` with the
    rollout method's weight granularity; a test checks these against real QTensors)."""

    bits: int
    block: int = 0
    block_scale: int = 0
    row_scale: int = 0
    tensor_scale: int = 0

    def nbytes(self, rows: int, cols: int) -> int:
        blocks = rows * math.ceil(cols / self.block) * self.block_scale if self.block else 0
        return rows * cols * self.bits // 8 + blocks + rows * self.row_scale + self.tensor_scale


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat(8, row_scale=4),  # codes + an fp32 scale per output channel
    "fp8_e4m3": WeightFormat(8, row_scale=4),
    "nvfp4": WeightFormat(4, block=16, block_scale=1, tensor_scale=4),  # E2M1 pairs, E4M3 per 16, fp32 per tensor
    "mxfp4": WeightFormat(4, block=32, block_scale=1),  # E2M1 pairs, E8M0 per 32
}
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # rollout.dtype


# ---- model shape ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One HF tensor: its name, shape, layer (None: embedding, final norm, lm_head) and kind, which says how
    it is sharded: vocab rows (embedding, output), replicated (norm, router), over TP (attention, mlp,
    shared_experts, bias) or over EP and ETP (experts)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_REPLICATED = ("norm", "router")


def model_config(path: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it came from) for `model.path`: the checkpoint's config.json when the
    path exists (or is "smollm2" / "tiny-<arch>"), else the architecture card of its basename."""
    from ..models.cards import card

    if path == "smollm2" or path.startswith("tiny-"):
        from ..models import resolve_model_path

        path = str(resolve_model_path(path))
    config = Path(path) / "config.json"
    if config.is_file():
        import json

        return json.loads(config.read_text()), str(config)
    try:
        return card(path), f"card {Path(path).name} (qurl_mcore/models/cards.py; {path} is not on this machine)"
    except KeyError as err:
        raise ValueError(err.args[0]) from None


@dataclass(frozen=True)
class Shape:
    """The fields of an HF config.json that size a model."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int
    topk: int
    moe_intermediate: int
    shared_intermediate: int
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, hf: dict[str, Any]) -> Shape:
        h, a = hf["hidden_size"], hf["num_attention_heads"]
        return cls(
            model_type=hf.get("model_type", ""), hidden=h, intermediate=hf.get("intermediate_size", 0),
            layers=hf["num_hidden_layers"], heads=a, kv_heads=hf.get("num_key_value_heads") or a,
            head_dim=hf.get("head_dim") or h // a, vocab=hf["vocab_size"],
            tied=bool(hf.get("tie_word_embeddings", False)), experts=num_experts(hf),
            topk=hf.get("num_experts_per_tok") or 0, moe_intermediate=hf.get("moe_intermediate_size") or 0,
            shared_intermediate=hf.get("shared_expert_intermediate_size") or 0,
            qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=hf.get("model_type") in ("qwen3", "qwen3_moe"))

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV cache per token: 2 (k, v) · L · g · d · bytes, per GPU of a TP engine (g/TP heads, at least one)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


@functools.lru_cache(maxsize=64)
def _quantized(s: Shape, precision: str, scope: str, side: str) -> frozenset[str]:
    """HF weight names `precision.quantized_linears` gives for this shape (cached: MoE models have 10^4+)."""
    c = {"num_hidden_layers": s.layers, "num_experts": s.experts,
         "shared_expert_intermediate_size": s.shared_intermediate}
    return frozenset(n + ".weight" for n in quantized_linears(c, precision, scope, side))


def _layer_tensors(s: Shape, i: int, ep: int) -> dict[str, list[Tensor]]:
    """Layer i's tensors by export rule (`megatron.convert.NAME_TABLE` order)."""
    h, d, a, g = s.hidden, s.head_dim, s.heads, s.kv_heads

    def t(name: str, shape: tuple[int, ...], kind: str) -> Tensor:
        return Tensor(f"model.layers.{i}.{name}", shape, i, kind)

    rules: dict[str, list[Tensor]] = {
        "input_layernorm": [t("input_layernorm.weight", (h,), "norm")],
        "qkv": [t(f"self_attn.{x}_proj.weight", (n * d, h), "attention") for x, n in zip("qkv", (a, g, g))],
        "qkv_bias": [t(f"self_attn.{x}_proj.bias", (n * d,), "bias") for x, n in zip("qkv", (a, g, g))]
        if s.qkv_bias else [],
        "q_norm": [t("self_attn.q_norm.weight", (d,), "norm")] if s.qk_norm else [],
        "k_norm": [t("self_attn.k_norm.weight", (d,), "norm")] if s.qk_norm else [],
        "o_proj": [t("self_attn.o_proj.weight", (h, a * d), "attention")],
        "post_attention_layernorm": [t("post_attention_layernorm.weight", (h,), "norm")],
    }
    if not s.experts:
        i_ = s.intermediate
        rules["fc1"] = [t(f"mlp.{x}_proj.weight", (i_, h), "mlp") for x in ("gate", "up")]
        rules["fc2"] = [t("mlp.down_proj.weight", (h, i_), "mlp")]
        return rules
    im, local = s.moe_intermediate, s.experts // ep
    order = [r * local + j for j in range(local) for r in range(ep)]  # local expert j of each EP rank r
    rules["router"] = [t("mlp.gate.weight", (s.experts, h), "router")]
    rules["experts_fc1"] = [t(f"mlp.experts.{e}.{x}_proj.weight", (im, h), "experts") for e in order
                            for x in ("gate", "up")]
    rules["experts_fc2"] = [t(f"mlp.experts.{e}.down_proj.weight", (h, im), "experts") for e in order]
    if s.shared_intermediate:
        si = s.shared_intermediate
        rules["shared"] = [t(f"mlp.shared_expert.{x}_proj.weight", shape, "shared_experts")
                           for x, shape in (("gate", (si, h)), ("up", (si, h)), ("down", (h, si)))]
    return rules


@functools.lru_cache(maxsize=64)
def hf_tensors(s: Shape, pp: int = 1, ep: int = 1) -> tuple[Tensor, ...]:
    """Every HF tensor of the model, in the order `megatron.export_hf_weights` yields them under PP stages and
    EP: stage by stage; within a stage rule by rule (embedding, each per-layer rule over the stage's layers,
    final norm, lm_head unless tied)."""
    if s.layers % pp:
        raise ValueError(f"train.pp_size: {pp} must divide the model's {s.layers} layers")
    per = s.layers // pp
    out: list[Tensor] = []
    for stage in range(pp):
        if stage == 0:
            out.append(Tensor("model.embed_tokens.weight", (s.vocab, s.hidden), None, "embedding"))
        layers = [_layer_tensors(s, i, ep) for i in range(stage * per, (stage + 1) * per)]
        for rule in layers[0] if layers else ():
            for by_rule in layers:
                out.extend(by_rule[rule])
        if stage == pp - 1:
            out.append(Tensor("model.norm.weight", (s.hidden,), None, "norm"))
            if not s.tied:
                out.append(Tensor("lm_head.weight", (s.vocab, s.hidden), None, "output"))
    return tuple(out)


def parameter_count(s: Shape) -> int:
    """Parameters of the model (a tied embedding counted once), as `sum(p.numel())` of the HF model."""
    return sum(t.numel for t in hf_tensors(s))


# ---- trainer ----------------------------------------------------------------------------------------------

@dataclass
class _Stage:
    dense: int = 0  # parameters one rank of the stage holds outside the experts
    expert: int = 0
    trained_quantized: int = 0  # of those, in linears the trainer quantizes (precision.quantized_linears, train)
    layers: int = 0


def _stages(s: Shape, cfg: Config) -> list[_Stage]:
    """The parameters of one rank of each pipeline stage."""
    t = cfg.train
    tp, pp, ep = t.tp_size, t.pp_size, t.ep_size
    etp = 1 if ep > 1 else tp
    per = s.layers // pp
    quantized = _quantized(s, cfg.precision, cfg.scope, "train")
    stages = [_Stage(layers=per) for _ in range(pp)]
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
      attention   norm + x·h (QKV input) + e·a·d (q after RoPE) + x·a·d (o_proj input, which SDPA also keeps
                  as its output) [+ e·(3a+3g)·d with q/k norms: their inputs, outputs and the QKV output]
      core        e·s (SDPA's additive mask, b·s² per micro-batch) + 4a (log-sum-exp)
                  + 2e·a·d (k, v repeated to a heads) or, without grouping, e·a·d + e·(a+2g)·d (k after
                  RoPE; v, a view of the QKV output)
      selective   core recomputed: the checkpoint keeps its inputs instead, k (e·g·d) and v (the QKV output,
                  e·(a+2g)·d, unless q/k norms keep it already)
      dense MLP   norm + x·h (fc1 input) + 4e·i (fc1 output [gate; up], silu(gate), up + 0 in Megatron's glu)
                  + x·i (fc2 input)
      MoE         norm + e·h (router input) + 5E + 24k (router scores, probabilities, top-k maps)
                  + k·(x·h + 5e·i_m + 4 + x·i_m) per routed copy: expert fc1 input, fc1 output, silu, up + 0,
                  the product scaled by its routing probability (and that probability), fc2 input
                  [+ 4e·i_s + x·i_s, a shared expert]
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
    if s.experts:
        im, xe = s.moe_intermediate, x["experts"]
        mlp = norm + e * h + 5 * s.experts + 24 * s.topk + s.topk * (xe * h + 5 * e * im + 4 + xe * im)
        if s.shared_intermediate:
            mlp += 4 * e * s.shared_intermediate + x["shared_experts"] * s.shared_intermediate
    else:
        mlp = norm + x["mlp"] * h + 4 * e * s.intermediate + x["mlp"] * s.intermediate
    return {"attention": attention, "core": core, "selective": selective, "mlp": mlp}


def activation_bytes(s: Shape, cfg: Config, recompute: str, e: int = 2) -> list[int]:
    """Activation bytes of the training step on one rank of each pipeline stage, e bytes per element, at its
    peak: the end of the forward, when every layer's saved tensors (`layer_activation_bytes`) and the logits
    are alive. With sequence parallelism all of it /TP, per layer and micro-batch of b sequences of s:
      none        b·s·(attention + core + mlp)/TP + 4·e·d·s (RoPE's cos and sin for q and k)
      selective   the same with `selective` in place of `core`
      full        e·h·s·b/TP (the checkpointed layer input) plus one layer's whole set, recomputed
    Times the micro-batches in flight on the stage (1F1B: PP − stage, at most the micro-batches of a step).
    Plus, on the last stage, the logits s·b·V/TP·(e + 4 + 4) (the model's output, its fp32 copy / temperature,
    and the contiguous copy vocab_parallel_cross_entropy exponentiates and keeps: megatron/logprobs.py), and
    for quantized-training precisions the fp32 weights each quantized linear keeps for its backward (all of
    the stage's, or one layer's under full recompute).
    """
    if recompute not in RECOMPUTE_ORDER:
        raise ValueError(f"train.recompute: {recompute!r} is not one of {list(RECOMPUTE_ORDER)}")
    t = cfg.train
    sq = cfg.rollout.context_length
    tokens = sq * t.micro_batch_size
    per = layer_activation_bytes(s, cfg, e)
    rope = 4 * e * s.head_dim * sq
    layer_all = tokens * (per["attention"] + per["core"] + per["mlp"]) // t.tp_size + rope
    out = []
    for k, st in enumerate(_stages(s, cfg)):
        inflight = min(t.pp_size - k, _microbatches(cfg))
        if recompute == "none":
            layers = st.layers * layer_all
        elif recompute == "selective":
            layers = st.layers * (tokens * (per["attention"] + per["selective"] + per["mlp"]) // t.tp_size + rope)
        else:
            layers = st.layers * tokens * e * s.hidden // t.tp_size + layer_all
        weights = 4 * st.trained_quantized // (st.layers if recompute == "full" else 1)
        logits = tokens * math.ceil(s.vocab / t.tp_size) * (e + 8) if k == t.pp_size - 1 else 0
        out.append(inflight * (layers + weights) + logits)
    return out


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
                          "peak": static + stage_acts[t.recompute]})
    worst = max(per_stage, key=lambda x: x["peak"])
    return {**worst, "dtype": "bf16" if p == 2 else "fp32", "distributed_optimizer": distributed,
            "recompute": t.recompute, "microbatches_per_step": _microbatches(cfg)}


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
    plugin keeps besides), `experts` and `embedding` (parts of those); per GPU of its `tp`, `gpu_weights`
    (all but the replicated norms and routers /TP) and `gpu_masters`."""
    names = _quantized(s, precision, scope, "rollout")
    b = _DTYPE_BYTES[dtype]
    out = dict.fromkeys(("quantized", "full", "masters", "experts", "embedding", "replicated"), 0)
    for x in hf_tensors(s):
        n = WEIGHT_FORMATS[fmt].nbytes(*x.shape) if x.name in names else x.numel * b
        out["quantized" if x.name in names else "full"] += n
        out["masters"] += x.numel * b if x.name in names else 0
        out["experts"] += n if x.kind == "experts" else 0
        out["embedding"] += n if x.kind == "embedding" else 0
        out["replicated"] += n if x.kind in _REPLICATED else 0
    sharded = out["quantized"] + out["full"] - out["replicated"]
    return {**out, "gpu_weights": sharded // tp + out["replicated"], "gpu_masters": out["masters"] // tp}


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
    1 GiB to spare, rounded up to a hundredth.
    `precision` None: the config's; "bf16" sizes the same engine unquantized."""
    tp = cfg.rollout.tp_size
    row, scope, fmt = cfg.resolved_precision()
    w = engine_weights(s, precision or row.name, scope, fmt, cfg.rollout.dtype, tp)
    reserve, graphs = sglang_reserve(gpu, tp)
    on_device = w["gpu_weights"] + (w["gpu_masters"] if master == "device" else 0)
    per_token = s.kv_bytes_per_token(_DTYPE_BYTES[cfg.rollout.dtype], tp)
    if kv_tokens is None:
        room = cfg.rollout.mem_fraction * gpu.hbm - graphs if cfg.rollout.mem_fraction else gpu.hbm - reserve
        kv_tokens = cfg.rollout.max_total_tokens or max(0, int(room - on_device) // per_token)
    kv = kv_tokens * per_token
    return {"weights": w, "master": master, "kv_bytes_per_token": per_token, "kv_tokens": kv_tokens, "kv": kv,
            "reserve": reserve, "cuda_graphs": graphs, "peak": on_device + kv + reserve,
            "released": reserve - graphs,
            "mem_fraction": math.ceil(100 * (on_device + kv + graphs + GiB) / gpu.hbm) / 100,
            "host_masters": w["gpu_masters"] if master == "host" else 0}


# ---- weight push ------------------------------------------------------------------------------------------

def push_bytes(s: Shape, cfg: Config) -> dict[str, Any]:
    """One weight push: every HF tensor in rollout.dtype, in export order, grouped greedily into buckets of at
    most rollout.push_bucket_mb MiB (a larger tensor travels alone: `transfer.buckets`)."""
    b, limit = _DTYPE_BYTES[cfg.rollout.dtype], cfg.rollout.push_bucket_mb << 20
    buckets, size, largest = 0, 0, 0
    for x in hf_tensors(s, cfg.train.pp_size, cfg.train.ep_size):
        n = x.numel * b
        largest = max(largest, n)
        if buckets == 0 or size + n > limit:
            buckets, size = buckets + 1, 0
        size += n
    return {"bytes": parameter_count(s) * b, "buckets": buckets, "bucket_bytes": limit, "largest_tensor": largest}


def push_seconds(nbytes: int, gb_s: float) -> float:
    """Transfer time at `gb_s` GB/s (the wire only: export gathers and re-quantization are extra)."""
    return nbytes / (gb_s * GB)


# ---- decode ceiling ---------------------------------------------------------------------------------------

def decode_tokens_per_s(s: Shape, weights: dict[str, int], gpu: GPU, tp: int, fmt: str | None, batch: int,
                        context: int, kv_per_token: int) -> float:
    """Upper bound on one engine's decode tokens/s for `batch` sequences of mean length `context`:
      batch / max(bytes_step / (TP·HBM bandwidth), flops_step / (TP·peak of fmt's GEMMs))
      bytes_step = weights read (all but the embedding table when untied; of the experts the expected share
                   a batch touches, 1 − (1 − k/E)^batch, routing uniform) + batch·context·KV bytes per token
      flops_step = batch·(2·active parameters + 4·L·a·d·context)
    `weights`: `engine_weights` of the engine; `kv_per_token` over the whole engine."""
    touched = 1 - (1 - s.topk / s.experts) ** batch if s.experts else 1.0
    table = 0 if s.tied else weights["embedding"]
    w_read = weights["quantized"] + weights["full"] - table - weights["experts"] * (1 - touched)
    embedding = 0 if s.tied else s.vocab * s.hidden
    expert_params = sum(x.numel for x in hf_tensors(s) if x.kind == "experts")
    active = parameter_count(s) - embedding - expert_params * (1 - (s.topk / s.experts if s.experts else 0))
    flops = batch * (2 * active + 4 * s.layers * s.heads * s.head_dim * context)
    seconds = max((w_read + batch * context * kv_per_token) / (tp * gpu.hbm_tb_s * 1e12),
                  flops / (tp * gpu.peak_tflops(fmt) * 1e12))
    return batch / seconds


def rollout_ceiling(s: Shape, cfg: Config, gpu: GPU, master: str = "host",
                    beside: int | None = None) -> dict[str, Any]:
    """The decode ceiling of one engine, bf16 against the config's precision (each engine with the KV cache it
    gets): at batch 1 (weight-bound: the most quantized weights can buy) and at the step's batch (the
    sequences each engine gets, as many as its KV cache holds at mean length context_length/2). `beside`: the
    bytes of a colocated trainer rank, when the KV cache is what is left beside it."""
    r = cfg.rollout
    _, _, fmt = cfg.resolved_precision()
    context = r.context_length // 2
    wanted = math.ceil(cfg.data.prompts_per_step * r.samples_per_prompt / r.engines)
    out: dict[str, Any] = {"context": context, "sequences_per_engine": wanted}
    for label, precision, f in (("bf16", "bf16", None), ("quantized", None, fmt)):
        kv = None if beside is None else _kv_beside(s, cfg, gpu, master, beside, precision)
        eng = engine_bytes(s, cfg, gpu, master, kv, precision)
        batch = max(1, min(wanted, eng["kv_tokens"] // context))
        per_token = eng["kv_bytes_per_token"] * r.tp_size
        args = (s, eng["weights"], gpu, r.tp_size, f)
        out[label] = {"batch": batch, "kv_tokens": eng["kv_tokens"],
                      "tokens_per_s_batch1": decode_tokens_per_s(*args, 1, context, per_token),
                      "tokens_per_s": decode_tokens_per_s(*args, batch, context, per_token)}
    out["ratio_batch1"] = out["quantized"]["tokens_per_s_batch1"] / out["bf16"]["tokens_per_s_batch1"]
    out["ratio"] = out["quantized"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out


# ---- the plan ---------------------------------------------------------------------------------------------

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

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("model", "hardware", "trainer", "engines", "push", "rollout",
                                              "verdict", "problems")}


def _kv_beside(s: Shape, cfg: Config, gpu: GPU, master: str, other: int, precision: str | None = None) -> int:
    """The KV tokens (a multiple of 1024) an engine GPU holds at its peak beside `other` bytes: as many as fit,
    at most enough for all of the engine's sequences of a step at rollout.context_length."""
    eng = engine_bytes(s, cfg, gpu, master, 0, precision)
    fit = max(0, (gpu.hbm - other - eng["peak"]) // eng["kv_bytes_per_token"]) // 1024 * 1024
    r = cfg.rollout
    wanted = math.ceil(cfg.data.prompts_per_step * r.samples_per_prompt / r.engines) * r.context_length
    return min(fit, -(-wanted // 1024) * 1024)


def _budget(s: Shape, cfg: Config, gpu: GPU, master: str) -> dict[str, Any]:
    """Trainer and engine bytes, the peak of each kind of GPU the layout has, and whether each fits.

    A colocated GPU holds a trainer rank and an engine. Without rollout.offload both keep their peaks at
    once. With it the engine gives its memory back while the trainer steps and the trainer empties its
    allocator's cache before the engine takes it again, so the GPU's peak is the larger of
      training   the trainer's peak + what the released engine keeps
      rollout    the trainer's states (no activations) + the engine's peak"""
    trainer = trainer_bytes(s, cfg)
    push = push_bytes(s, cfg)
    export = trainer["static"] + push["bucket_bytes"] + 2 * push["largest_tensor"]  # gathered, concatenated
    trainer_peak = max(trainer["peak"], export)
    offload = cfg.offload_rollout(cuda=True)
    colocated = cfg.layout == "colocated"
    resident = export if offload else trainer_peak  # what a trainer rank holds while its engine is up
    r = cfg.rollout
    beside = resident if colocated and not r.max_total_tokens and not r.mem_fraction else None
    engine = engine_bytes(s, cfg, gpu, master, None if beside is None else _kv_beside(s, cfg, gpu, master, beside))
    kv_ok = engine["kv_tokens"] >= r.context_length
    if colocated:
        shared = max(trainer_peak + engine["released"], resident + engine["peak"]) if offload else \
            trainer_peak + engine["peak"]
        gpus = {"trainer+engine": (shared, kv_ok)}
        if r.engines < cfg.train.world_size:
            gpus["trainer"] = (trainer_peak, True)
    else:
        gpus = {"trainer": (trainer_peak, True), "engine": (engine["peak"], kv_ok)}
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
    elif r.mem_fraction and r.max_total_tokens and r.mem_fraction < engine["mem_fraction"]:
        problems.append(f"rollout.mem_fraction: {r.mem_fraction} of a {gpu.name} holds less than the engine's weights "
                        f"and its KV cache of rollout.max_total_tokens={r.max_total_tokens}; use "
                        f"{engine['mem_fraction']}, or fewer tokens")
    return rows, problems


def _nodes_needed(cfg: Config, gpus_per_node: int) -> int:
    """Nodes of `gpus_per_node` GPUs the placement (`loop.actors.plan`) fills; engines do not span nodes."""
    from ..loop.actors import plan as placement

    p = placement(cfg, use_gpu=True)
    trainer = math.ceil(len(p.trainer) / gpus_per_node)
    if cfg.layout == "colocated":
        return trainer
    per_node = gpus_per_node // cfg.rollout.tp_size
    if per_node == 0:
        raise ValueError(f"rollout.tp_size: {cfg.rollout.tp_size} GPUs per engine exceed the {gpus_per_node} GPUs "
                         "of a node; engines do not span nodes")
    return trainer + math.ceil(len(p.engines) / per_node)


def plan(cfg: Config, hf: dict[str, Any], gpu: str, gpus_per_node: int = 8, nodes: int | None = None,
         master: str = "host", link: str | None = None, source: str = "") -> Plan:
    """The plan of `cfg` for the model of config.json `hf` on `gpu` (a key of `GPUS`): every section of the
    module docstring. `master`: where the engines keep full-precision masters (the plugin's default: host).
    `link`: the push's link (default: CUDA IPC on the same GPU when colocated, NVLink when disaggregated on one
    node, InfiniBand across nodes). Raises ValueError naming a bad value."""
    g = get_gpu(gpu)
    if master not in ("host", "device"):
        raise ValueError(f"master {master!r}: use host (the plugin's default) or device")
    if link is not None and link not in LINK_NAMES:
        raise ValueError(f"unknown link {link!r}; use one of {list(LINK_NAMES)}")
    s = Shape.of(hf)
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
               "layers": s.layers, "experts": s.experts, "shape_only": bool(hf.get("shape_only"))},
        hardware={"gpu": g.name, "hbm_gib": g.hbm / GiB, "hbm_tb_s": g.hbm_tb_s, "bf16_tflops": g.tflops["bf16"],
                  "gpus_per_node": gpus_per_node, "nodes_needed": needed, "layout": cfg.layout,
                  "offload": budget["offload"]},
        trainer={**budget["trainer"], "peak_with_push": budget["trainer_peak"],
                 "split": {"tp": cfg.train.tp_size, "pp": cfg.train.pp_size, "ep": cfg.train.ep_size,
                           "dp": cfg.train.dp_size}},
        engines={**engine, "precision": precision.name, "scope": scope, "format": fmt, "tp": tp,
                 "count": cfg.rollout.engines, "host_masters_per_node": engine["host_masters"] * tp * engines_per_node},
        push={**push, "dtype": cfg.rollout.dtype, "link": chosen, "seconds": times[chosen], "seconds_by_link": times},
        rollout=rollout_ceiling(s, cfg, g, master, budget["beside"]),
        verdict=verdict, problems=problems)


def check_fits(cfg: Config, hf_config: dict[str, Any], gpu: str) -> list[str]:
    """The memory problems of `cfg` on `gpu` (a key of `GPUS`), each naming the lever that fixes it; empty when
    every GPU of the layout fits. For `preflight` on GPU targets: `problems += check_fits(cfg, hf, gpu)`."""
    return plan(cfg, hf_config, gpu).problems


# ---- the report -------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def format_plan(p: Plan) -> str:
    """The plan as the lines `qurl plan` prints."""
    t, e, pu, ro, hw = p.trainer, p.engines, p.push, p.rollout, p.hardware
    which = "distributed" if t["distributed_optimizer"] else "replicated"
    w = e["weights"]
    lines = [
        (f"model     {p.model['source']}: {p.model['model_type']}, {p.model['parameters'] / 1e9:.2f}B parameters, "
         f"{p.model['layers']} layers" + (f", {p.model['experts']} experts" if p.model["experts"] else "")
         + (" (shape only)" if p.model["shape_only"] else "")),
        f"hardware  {hw['gpu']} ({hw['hbm_gib']:.1f} GiB, {hw['hbm_tb_s']} TB/s), {hw['layout']}, "
        f"{hw['nodes_needed']} node(s) of {hw['gpus_per_node']} GPUs",
        f"trainer   per GPU (TP {t['split']['tp']} PP {t['split']['pp']} EP {t['split']['ep']} DP "
        f"{t['split']['dp']}, {t['dtype']}, {t['parameters'] / 1e9:.2f}B parameters on the fullest stage):",
        (f"            params {_gib(t['params'])}, gradients {_gib(t['gradients'])}"
         + (f", reference model {_gib(t['reference'])}" if t["reference"] else "")),
        f"            main params + Adam {_gib(t['main_params']['replicated'] + t['optimizer']['replicated'])} "
        f"replicated, {_gib(t['main_params']['distributed'] + t['optimizer']['distributed'])} with the "
        f"distributed optimizer (using {which})",
        ("            activations: " + ", ".join(f"{r} {_gib(v)}" for r, v in t["activations"].items())
         + f" (using {t['recompute']}; {t['microbatches_per_step']} micro-batch(es) per step)"),
        f"            peak {_gib(t['peak'])} (with a push's export {_gib(t['peak_with_push'])})",
        (f"engines   {e['count']} x TP {e['tp']}, {e['precision']} ({e['format'] or 'bf16'}, scope {e['scope']}); "
         f"per GPU: weights {_gib(w['gpu_weights'])}, masters {_gib(w['gpu_masters'])} on the {e['master']}, KV "
         f"cache {_gib(e['kv'])} ({e['kv_tokens']} tokens), SGLang reserve {_gib(e['reserve'])}; peak "
         f"{_gib(e['peak'])}, rollout.mem_fraction {e['mem_fraction']}"
         + (f"; released while the trainer steps: {_gib(e['released'])} stay" if p.hardware["offload"] else "")
         + (f"; host RAM for masters {_gib(e['host_masters_per_node'])} per node" if e["host_masters"] else "")),
        (f"push      {pu['bytes'] / GB:.2f} GB in {pu['dtype']}, {pu['buckets']} bucket(s) of <= "
         f"{pu['bucket_bytes'] >> 20} MiB; {pu['seconds']:.2f} s on {pu['link']} ("
         + ", ".join(f"{k} {v:.2f} s" for k, v in pu["seconds_by_link"].items()) + ")"),
        f"rollout   decode ceiling per engine, tokens/s bf16 -> {e['precision']}: batch 1 "
        f"{ro['bf16']['tokens_per_s_batch1']:.0f} -> {ro['quantized']['tokens_per_s_batch1']:.0f} "
        f"(x{ro['ratio_batch1']:.2f}); batch {ro['bf16']['batch']} -> {ro['quantized']['batch']} of "
        f"{ro['context']} tokens: {ro['bf16']['tokens_per_s']:.0f} -> {ro['quantized']['tokens_per_s']:.0f} "
        f"(x{ro['ratio']:.2f})",
    ]
    for v in p.verdict:
        state = f"fits, {v['margin_gib']:.1f} GiB free" if v["fits"] else "does NOT fit"
        lines.append(f"verdict   {v['gpu']} GPU: {v['peak_gib']:.1f} of {v['hbm_gib']:.1f} GiB, {state}")
    lines += [f"problem   {x}" for x in p.problems]
    return "\n".join(lines)
