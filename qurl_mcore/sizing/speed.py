"""How fast a run moves weights and tokens: the bytes, buckets and wire time of one weight push, and the decode
ceiling of one engine (tokens/s bound by HBM bandwidth and tensor-core peak), bf16 against the config's
precision."""
from __future__ import annotations

import functools
import math
from typing import Any

from ..config import Config
from ..models.slots import Shape
from ..precision import METHODS
from ..quant.formats import FORMATS, TRITON_FP4
from ..quant.linear import QuantLinearSpec
from ..quant.wire import COLUMNS, ROWS, wire_specs
from .gpus import GB, GPU, NVLINK_ALLREDUCE_S
from .memory import _kv_beside, engine_bytes
from .tensors import _DTYPE_BYTES, _quantized, hf_tensors, parameter_count


# ---- weight push ------------------------------------------------------------------------------------------

def push_bytes(s: Shape, cfg: Config) -> dict[str, Any]:
    """One weight push: every HF tensor in rollout.dtype (the router's expert bias in fp32), or for a code push
    (`Config.push_mode`) each weight the engines quantize as its wire tensors (`quant.wire.wire_specs`: its codes
    and scales as rollout.tp_size engine ranks quantize their shards, so a row-parallel weight's per-channel
    scales travel as [rows, t], 4·rows·(t − 1) bytes more than the whole weight's), in export order, grouped
    greedily into buckets of at most rollout.push_bucket_mb MiB (a larger tensor travels alone:
    `transfer.buckets`)."""
    b, limit = _DTYPE_BYTES[cfg.rollout.dtype], cfg.rollout.push_bucket_mb << 20
    row, scope, fmt = cfg.resolved_precision()
    codes = _quantized(s, row.name, scope, "rollout") if cfg.push_mode(s) == "codes" else frozenset()
    spec = cfg.recipe(te_available=False).engine.spec if codes else None
    buckets, size, largest, total = 0, 0, 0, 0
    for x in hf_tensors(s, cfg.train.pp_size, cfg.train.ep_size):
        n = _wire_bytes(x.shape, spec, COLUMNS if x.columns else ROWS, cfg.rollout.tp_size) if x.name in codes \
            else x.bytes(b)
        largest, total = max(largest, n), total + n
        if buckets == 0 or size + n > limit:
            buckets, size = buckets + 1, 0
        size += n
    return {"bytes": total, "buckets": buckets, "bucket_bytes": limit, "largest_tensor": largest,
            "codes": fmt if codes else None}


@functools.lru_cache(maxsize=256)
def _wire_bytes(shape: tuple[int, ...], spec: QuantLinearSpec, split: int, shards: int) -> int:
    """Bytes of the wire tensors of one weight of `shape` (cached: an MoE's experts share a few shapes)."""
    return sum(math.prod(dims) * dtype.itemsize for dtype, dims in wire_specs("w", shape, spec, split, shards).values())


#: a full weight sync measured end to end (export gathers, buckets, the engines' loaders): miles' report
MEASURED_PUSH = {"model": "Qwen3-30B-A3B", "seconds": 2.67, "over": "NCCL on H100", "source": "miles"}


def push_seconds(nbytes: int, gb_s: float) -> float:
    """Transfer time at `gb_s` GB/s (the wire only: export gathers and re-quantization are extra)."""
    return nbytes / (gb_s * GB)


# ---- decode ceiling ---------------------------------------------------------------------------------------

def latency_floor_s(s: Shape, tp: int) -> float:
    """The seconds of a decode step's TP all-reduces: 2·L (after attention and after the MLP) of
    `NVLINK_ALLREDUCE_S` each at TP > 1, none at TP 1."""
    return 2 * s.layers * NVLINK_ALLREDUCE_S if tp > 1 else 0.0


#: how an engine runs a format's GEMMs: on the GPU's tensor cores for the format (bf16, and INT8/FP8 through
#: SGLang's W8A8 kernels), on the FP4 Triton kernels (`qurl_mcore.kernels`: packed weights decoded in
#: registers, bf16 MMAs), or emulated (every weight dequantized to bf16 for every GEMM)
TENSOR_CORES, FP4_KERNELS, EMULATED = "tensor cores", "fp4 kernels", "emulated"


def gemm_path(gpu: GPU, fmt: str | None) -> tuple[str, float]:
    """(How an engine on `gpu` runs `fmt`'s GEMMs, their dense peak TFLOP/s). The FP4 kernels multiply in
    bf16 on every GPU (on exactly representable values), so they run at bf16's peak, reading 4-bit weights."""
    if fmt is not None and TRITON_FP4 in FORMATS[fmt].kernels:
        return FP4_KERNELS, gpu.peak_tflops(None)
    return (TENSOR_CORES if gpu.has_tensor_cores(fmt) else EMULATED), gpu.peak_tflops(fmt)


def decode_tokens_per_s(s: Shape, weights: dict[str, int], gpu: GPU, tp: int, tflops: float, batch: int,
                        context: int, kv_per_token: int, rc_active: float = 0.0) -> float:
    """Upper bound on one engine's decode tokens/s for `batch` sequences of mean length `context`:
      batch / (max(bytes_step / (TP·HBM bandwidth), flops_step / (TP·tflops)) + latency_step)
      bytes_step = weights read (all but the embedding table when untied; of the experts the expected share
                   a batch touches, 1 − (1 − k/E)^batch, routing uniform) + batch·context·KV bytes per token
      flops_step = batch·(2·(active parameters + rc_active) + 4·L·a·d·context)
      latency_step = `latency_floor_s`, added: each layer's all-reduces wait for its GEMMs and the next
                     layer's GEMMs for them (TP decode overlaps neither)
    `weights`: `engine_weights` of the engine as its GEMMs read them; `tflops`: their peak (`gemm_path`);
    `rc_active`: active parameters multiplied a second time (residual correction's second product);
    `kv_per_token` over the whole engine."""
    touched = 1 - (1 - s.topk / s.experts) ** batch if s.experts else 1.0
    table = 0 if s.tied else weights["embedding"]
    w_read = weights["quantized"] + weights["full"] - table - weights["experts"] * (1 - touched)
    embedding = 0 if s.tied else s.vocab * s.hidden
    expert_params = sum(x.numel for x in hf_tensors(s) if x.kind == "experts")
    active = parameter_count(s) - embedding - expert_params * (1 - (s.topk / s.experts if s.experts else 0))
    flops = batch * (2 * (active + rc_active) + 4 * s.layers * s.heads * s.head_dim * context)
    seconds = max((w_read + batch * context * kv_per_token) / (tp * gpu.hbm_tb_s * 1e12),
                  flops / (tp * tflops * 1e12)) + latency_floor_s(s, tp)
    return batch / seconds


def rc_active_parameters(s: Shape, precision: str, scope: str) -> float:
    """The active parameters of the linears an engine quantizes (experts at their routed share k/E): what
    residual correction multiplies twice."""
    names = _quantized(s, precision, scope, "rollout")
    share = s.topk / s.experts if s.experts else 1.0
    return sum(x.numel * (share if x.kind == "experts" else 1.0) for x in hf_tensors(s) if x.name in names)


def rollout_ceiling(s: Shape, cfg: Config, gpu: GPU, master: str = "host",
                    beside: int | None = None) -> dict[str, Any]:
    """The decode ceiling of one engine, bf16 against the config's precision (each engine with the KV cache it
    gets): at batch 1 (weight-bound: the most quantized weights can buy) and at the step's batch (the
    sequences each engine gets, as many as its KV cache holds at mean length context_length/2), each step
    with its TP all-reduces (`latency_floor_s`) on top. `beside`: the bytes of a colocated trainer rank, when
    the KV cache is what is left beside it. The quantized GEMMs run as `gemm_path` says: FP4 on the FP4
    kernels reads its packed weights (4.5 bits a weight for NVFP4, 4.25 for MXFP4, routed experts only) at
    bf16's peak, RC multiplying the quantized linears twice (a model until a GPU measures the kernels:
    `basis`); an emulated format reads bf16 weights at bf16's peak, so only its larger KV cache can differ."""
    r = cfg.rollout
    row, scope, fmt = cfg.resolved_precision()
    context = r.context_length // 2
    wanted = math.ceil(cfg.data.prompts_per_step * r.samples_per_prompt / r.engines)
    path, tflops = gemm_path(gpu, fmt)
    rc = row.rollout is not None and METHODS[row.rollout].mode in ("rc_forward", "rc_both")
    out: dict[str, Any] = {"context": context, "sequences_per_engine": wanted,
                           "latency_floor_s": latency_floor_s(s, r.tp_size), "gemm": path,
                           "basis": "model" + (" (the FP4 kernels not yet measured on a GPU)" if path == FP4_KERNELS
                                               else "")}
    for label, precision, f in (("bf16", "bf16", None), ("quantized", None, fmt)):
        kv = None if beside is None else _kv_beside(s, cfg, gpu, master, beside, precision)
        eng = engine_bytes(s, cfg, gpu, master, kv, precision)
        batch = max(1, min(wanted, eng["kv_tokens"] // context))
        per_token = eng["kv_bytes_per_token"] * r.tp_size
        if label == "bf16" or path != EMULATED:
            weights = eng["weights"]  # emulated: the bf16 engine's (bf16 runs first)
        quantized = label == "quantized"
        args = (s, weights, gpu, r.tp_size, tflops if quantized else gpu.peak_tflops(None))
        twice = rc_active_parameters(s, row.name, scope) if quantized and rc and path != EMULATED else 0.0
        out[label] = {"batch": batch, "kv_tokens": eng["kv_tokens"],
                      "tokens_per_s_batch1": decode_tokens_per_s(*args, 1, context, per_token, twice),
                      "tokens_per_s": decode_tokens_per_s(*args, batch, context, per_token, twice)}
    out["ratio_batch1"] = out["quantized"]["tokens_per_s_batch1"] / out["bf16"]["tokens_per_s_batch1"]
    out["ratio"] = out["quantized"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out
