"""Train-vs-rollout alignment per precision: MoEResQ's Table 2 at small scale (docs/align.md). The
top-k metrics need an MoE (Qwen3-MoE); a dense model (Llama, Qwen2, Qwen3: SmolLM2, whose MLP linears are
scope `experts`) gets the log-prob metrics only.

For each row, a precision of `qurl_mcore.precision.PRECISIONS` (by default `ROWS`: `ALIGNMENT_ROWS`, the
table's rows in MoEResQ's order: bf16, fp4, fp4_rc_rollout, fp4_rc_train, fp4_rc (RC on both sides), then
fp4+r3 and fp4_rc+r3: a precision with "+r3" scores the same rollouts with the trainer's routers replaying the
engine's experts, `qurl_mcore.megatron.replay`, which makes the top-k match 1 but not the log-probs) the rollout
side (a real SGLang
engine, `qurl_mcore.rollout.LocalEngine`, running the precision's method) samples a response to a few fixed
prompts, and the training side (a real Megatron GPTModel, `qurl_mcore.megatron`, built with the precision's
trainer side) scores exactly those sequences teacher-forced. Both load the same BF16 HF checkpoint and
quantize the same linears (`scope`; routers, norms, embeddings and the output layer never) in the same FP4
format (`fmt`).

Positions. Prompt p_0..p_{P-1}, response r_0..r_{N-1}, sequence x = p ‖ r. The metrics run over the N
response tokens: token r_i = x_{P+i} was sampled from the forward at position P-1+i, so its pair is

  rollout  log π_rollout(r_i) = Generation.output_logprobs[i]     experts = Generation.routed_experts[P-1+i]
  training log π_train(r_i)   = token_logprobs(...).logprobs[P+i]  experts = .routed_experts[:, 0, P-1+i]

(the engine's routed_experts row j is the routing of forwarded token j, rows 0..P+N-2; Megatron's routing
at position t is that of input token t). With l_i = log π_train(r_i), m_i = log π_rollout(r_i), the top-k
expert sets E_i,ℓ (training) and F_i,ℓ (rollout) of token position i in MoE layer ℓ of L, and T = N summed
over prompts:

  pcc                    = Pearson(exp l, exp m) = Σ(a_i − ā)(b_i − b̄) / √(Σ(a_i − ā)² Σ(b_i − b̄)²),
                           a = exp l, b = exp m                               (`rl.metrics.prob_pearson`)
  topk_match_frac        = 1/(T L) Σ_i,ℓ [E_i,ℓ = F_i,ℓ]                      (`rl.metrics.topk_match_fraction`)
  topk_overlap_mean      = 1/(T L) Σ_i,ℓ |E_i,ℓ ∩ F_i,ℓ| / k                  (`rl.metrics.topk_overlap_mean`)
  mean_abs_logprob_diff  = 1/T Σ_i |l_i − m_i|                                (`rl.metrics.mean_abs_logprob_diff`)

Precisions that share a rollout method share one engine and its sampled responses (fp4 and fp4_rc_train;
fp4_rc_rollout and fp4_rc), and precisions that share a trainer side share one Megatron model, so the five
rows cost three engine starts and three models.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from .models import ARCHITECTURES, resolve_model_path
from .precision import ALIGNMENT_ROWS, FP4_FORMATS, PRECISIONS, get_precision, select

# torch, SGLang, transformers and Megatron-Core (and the parts of qurl_mcore that import them: rollout, rl,
# megatron, models.tiny) are imported in the functions that measure: the CLI's parser imports this module.
if TYPE_CHECKING:
    import torch

    from .rollout import EngineConfig, Generation


#: short fixed prompts; the first `n` are used
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Question: what is 17 + 25? Answer:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Photosynthesis converts sunlight into",
    "import numpy as np\nx = np.",
    "Translate to German: good morning ->",
)
#: the metric keys of a row, in table order
METRICS = ("pcc", "topk_match_frac", "topk_overlap_mean", "mean_abs_logprob_diff")
#: a row name's suffix for rollout routing replay in the trainer (R3)
REPLAY = "+r3"
#: the default rows: MoEResQ's five, then naive FP4 and symmetric RC with routing replay
ROWS = (*ALIGNMENT_ROWS, "fp4" + REPLAY, "fp4_rc" + REPLAY)


def split_row(name: str) -> tuple[str, bool]:
    """(precision, replay) of a row name: a precision of the table, optionally with the suffix "+r3"."""
    return (name[:-len(REPLAY)], True) if name.endswith(REPLAY) else (name, False)


def check_precisions(names: Iterable[str] | None) -> list[str]:
    """The rows to run (`ROWS` when None), validated and deduplicated."""
    if names is None:
        return list(ROWS)
    names = list(dict.fromkeys(names))
    if not names:
        raise ValueError(f"no precisions given; use any of {list(PRECISIONS)}, each optionally with {REPLAY!r}")
    for name in names:
        get_precision(split_row(name)[0])
    return names


def default_model() -> Path:
    """The tiny random Qwen3-MoE (2 layers, 4 experts, top-2) with SmolLM2's tokenizer."""
    # lazy: loads torch; `qurl --help` imports this module for its options
    from .models.tiny import tiny_checkpoint

    return tiny_checkpoint("qwen3_moe")


def is_moe(model_path: str) -> bool:
    """Whether the checkpoint directory holds an MoE (then the routing metrics apply); refuses what the
    trainer cannot build."""
    model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{model_path} is a {model_type!r} checkpoint; use one of {list(ARCHITECTURES)}")
    return ARCHITECTURES[model_type].moe


def prompt_ids(model_path: str, n: int) -> list[list[int]]:
    """The first `n` of `PROMPTS`, tokenized with the checkpoint's tokenizer."""
    if not 1 <= n <= len(PROMPTS):
        raise ValueError(f"prompts must be between 1 and {len(PROMPTS)}, got {n}")
    # transformers only where a tokenizer is made (seconds to import)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok(p)["input_ids"] for p in PROMPTS[:n]]


def engine_config(method: str | None, model_path: str, *, scope: str = "experts", fmt: str = "nvfp4",
                  seed: int = 0, dtype: str = "float32", max_tokens: int = 4096, moe: bool = True) -> EngineConfig:
    """A CPU engine serving `model_path` under `method` (with routed-expert capture for an MoE); fp32
    activations by default, like the trainer, so that only quantization separates the two sides."""
    # lazy: loads torch; `qurl --help` imports this module for its options
    from .rollout import EngineConfig

    options = {} if method is None else {"fmt": fmt, "scope": scope}
    return EngineConfig(str(model_path), method, options, device="cpu", dtype=dtype, mem_fraction_static=0.2,
                        max_total_tokens=max(4096, max_tokens), return_routed_experts=moe, random_seed=seed,
                        extra={"disable_radix_cache": True})  # every request computes all its tokens


def rollout(method: str | None, model_path: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
            scope: str = "experts", fmt: str = "nvfp4", seed: int = 0, dtype: str = "float32",
            moe: bool = True) -> list[Generation]:
    """One sampled response (temperature 1) per prompt from a fresh engine, with behaviour log-probs and
    (MoE) routed experts. The engine is seeded with `seed`, so a rerun samples the same tokens."""
    # lazy: loads torch; `qurl --help` imports this module for its options
    from .rollout import LocalEngine

    longest = max(map(len, prompts)) + max_new_tokens
    config = engine_config(method, model_path, scope=scope, fmt=fmt, seed=seed, dtype=dtype,
                           max_tokens=2 * len(prompts) * longest, moe=moe)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    with LocalEngine(config) as engine:
        return engine.generate([list(p) for p in prompts], sampling, routed_experts=moe)


def training_model(precision: str, model_path: str, *, scope: str = "experts", fmt: str | None = None):
    """A Megatron GPTModel of the checkpoint with the trainer side of `precision` (Megatron must be
    initialised)."""
    # lazy: torch and Megatron-Core load where the training side runs; `qurl --help` imports this module
    from .megatron.convert import load_hf_weights
    from .megatron.gpt import build_gpt
    from .recipe import resolve

    model = build_gpt(model_path, recipe=resolve(precision, scope, fmt))
    load_hf_weights(model, model_path)
    return model.eval()


def paired(model, generations: Sequence[Generation], replay: bool = False) -> dict[str, torch.Tensor]:
    """Train and rollout values of every response token, paired by position (module docstring); with `replay`
    the trainer's routers take the engine's experts (R3).

    Each sequence is scored alone (batch 1, no padding), as the engine saw it.
    Returns `train_logprobs`/`rollout_logprobs` [T] and, for an MoE, `train_experts`/`rollout_experts`
    [T, layers, k].
    """
    import torch  # lazy: torch and Megatron-Core; `qurl --help` imports this module

    from .megatron.logprobs import token_logprobs
    from .megatron.replay import RoutingTaps

    moe = bool(model.config.num_moe_experts)
    if replay and not moe:
        raise ValueError("routing replay (+r3) needs an MoE; this model is dense")
    taps = RoutingTaps(model) if moe else None
    # the engine reports every layer, the trainer its MoE layers (not a model's first dense ones): compare those
    moe_layers = [layer - 1 for layer in sorted(taps.taps)] if moe else []
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("train_logprobs", "rollout_logprobs")}
    if moe:
        out.update(train_experts=[], rollout_experts=[])
    for g in generations:
        p, n = len(g.prompt_ids), len(g.output_ids)
        if n == 0:
            continue
        ids = torch.tensor([g.prompt_ids + g.output_ids])
        if moe:
            if g.routed_experts is None or g.routed_experts.shape[0] != p + n - 1:
                got = None if g.routed_experts is None else g.routed_experts.shape
                raise RuntimeError(f"engine returned routed experts {got} for {p} prompt + {n} output tokens; "
                                   f"expected {p + n - 1} rows")
            routes = torch.from_numpy(g.routed_experts.copy())
            # the last token is never forwarded by the engine: its own routing (it scores nothing)
            taps.replay(torch.cat([routes, -torch.ones_like(routes[:1])])[None] if replay else None)
        with torch.no_grad():
            scored = token_logprobs(model, ids, return_routed_experts=moe)
        out["train_logprobs"].append(scored.logprobs[0, p:].double())
        out["rollout_logprobs"].append(torch.tensor(g.output_logprobs, dtype=torch.float64))
        if moe:
            out["train_experts"].append(scored.routed_experts[:, 0, p - 1:p + n - 1].transpose(0, 1).long())
            out["rollout_experts"].append(
                torch.from_numpy(g.routed_experts[p - 1:p + n - 1].copy()).long()[:, moe_layers])
    if moe:
        taps.replay(None)
    if not out["train_logprobs"]:
        raise RuntimeError("the engine generated no tokens")
    return {k: torch.cat(v) for k, v in out.items()}


def metrics(pairs: dict[str, torch.Tensor]) -> dict[str, object]:
    """The alignment metrics of `paired` values (module docstring), plus `topk_match_by_layer`; the top-k
    ones are None for a dense model."""
    # lazy: torch; `qurl --help` imports this module
    import torch

    from .rl.metrics import mean_abs_logprob_diff, prob_pearson, topk_match_fraction, topk_overlap_mean

    lt, lr = pairs["train_logprobs"], pairs["rollout_logprobs"]
    mask = torch.ones_like(lt, dtype=torch.bool)
    row = {"tokens": int(lt.numel()), "pcc": prob_pearson(lt, lr, mask), "topk_match_frac": None,
           "topk_overlap_mean": None, "mean_abs_logprob_diff": mean_abs_logprob_diff(lt, lr, mask),
           "topk_match_by_layer": None}
    if "train_experts" in pairs:
        by_layer, row["topk_match_frac"] = topk_match_fraction(pairs["train_experts"], pairs["rollout_experts"])
        _, row["topk_overlap_mean"] = topk_overlap_mean(pairs["train_experts"], pairs["rollout_experts"])
        row["topk_match_by_layer"] = [round(v, 6) for v in by_layer.tolist()]
    return row


@contextlib.contextmanager
def megatron_ready() -> Iterator[None]:
    """Megatron's groups at world size 1 for the duration, unless the caller already started them."""
    # lazy: Megatron-Core; `qurl --help` imports this module
    from megatron.core import parallel_state

    from .megatron.parallel import destroy_parallel, init_parallel

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    init_parallel()
    try:
        yield
    finally:
        destroy_parallel()


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to file descriptor 1 (SGLang's processes log there) to 2 for the duration, so
    that a command's stdout holds only its result."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _row_format(name: str, scope: str, fmt: str) -> tuple[str, str | None]:
    """(scope, format) of precision `name`: `fmt` where the precision takes it, else its own format."""
    p = get_precision(name)
    _, scope, fmt = select(name, scope, fmt if fmt in p.formats else None)
    return scope, fmt


def run_alignment(precisions: Iterable[str] | None = None, model_path: str | Path | None = None, *,
                  scope: str = "experts", fmt: str = "nvfp4", prompts: int = 4, max_new_tokens: int = 32,
                  seed: int = 0, dtype: str = "float32") -> list[dict]:
    """One row (a dict: precision, rollout, training, scope, fmt, model, tokens and the metrics) per
    precision.

    All rollouts run first (one engine per distinct rollout method and format), then Megatron scores them
    (one model per distinct trainer side). A dense model's default rows leave out the replay ones."""
    try:
        model_path = str(default_model() if model_path is None else resolve_model_path(str(model_path)))
    except FileNotFoundError:  # its message names model.path; here the flag is --model
        raise ValueError(f"--model {model_path}: no config.json there; give an HF checkpoint directory, "
                         "'smollm2' or 'tiny-<arch>'") from None
    moe = is_moe(model_path)
    names = check_precisions(precisions if precisions is not None or moe else ALIGNMENT_ROWS)
    if not moe and any(split_row(name)[1] for name in names):
        raise ValueError(f"{model_path} is a dense model: routing replay ({REPLAY}) needs an MoE; drop those rows")
    if fmt not in FP4_FORMATS:
        raise ValueError(f"fmt {fmt!r} is not an FP4 format; use one of {list(FP4_FORMATS)}")
    sides = {name: _row_format(split_row(name)[0], scope, fmt) for name in names}
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = prompt_ids(model_path, prompts)
    generations: dict[tuple, list[Generation]] = {}
    for name in names:
        key = (PRECISIONS[split_row(name)[0]].rollout, *sides[name])
        if key not in generations:
            generations[key] = rollout(key[0], model_path, ids, max_new_tokens=max_new_tokens, scope=key[1],
                                       fmt=key[2], seed=seed, dtype=dtype, moe=moe)
    rows = []
    with megatron_ready():
        models = {}  # (trainer mode, scope, format) -> model
        for name in names:
            precision, replay = split_row(name)
            p, (row_scope, row_fmt) = PRECISIONS[precision], sides[name]
            train_key = (p.train, p.train_granularity, row_scope, row_fmt if p.trains_quantized else None)
            if train_key not in models:
                models[train_key] = training_model(precision, model_path, scope=row_scope, fmt=row_fmt)
            row = {"precision": name, "rollout": p.rollout or "bf16",
                   "training": p.train + (f" ({p.train_granularity})" if p.train_granularity else "") +
                   (" + R3" if replay else ""), "scope": row_scope, "fmt": row_fmt or "bf16", "model": model_path}
            gens = generations[(p.rollout, row_scope, row_fmt)]
            row.update(metrics(paired(models[train_key], gens, replay=replay)))
            rows.append(row)
        models.clear()
    return rows


def measure(precision: str, model_path: str | Path | None = None, **kwargs) -> dict:
    """The row of one precision; keywords as `run_alignment`."""
    return run_alignment([precision], model_path, **kwargs)[0]


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table of `run_alignment` rows (metrics to 4 decimals)."""
    if not rows:
        raise ValueError("no rows to format")
    head = ["precision", "rollout", "training", "tokens", "PCC", "top-k match", "top-k overlap", "mean |Δ logp|"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        missing = [k for k in ("precision", "rollout", "training", "tokens", *METRICS) if k not in row]
        if missing:
            raise ValueError(f"row {row.get('precision', '?')!r} lacks {missing}")
        cells = [row["precision"], row["rollout"], row["training"], str(row["tokens"])]
        cells += ["—" if row[k] is None else f"{row[k]:.4f}" for k in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    formats = sorted({row["fmt"] for row in rows if row.get("fmt") in FP4_FORMATS})
    if "scope" in rows[0]:
        lines.append(f"\nscope {rows[0]['scope']}" + (f", FP4 format {', '.join(formats)}" if formats else ""))
    return "\n".join(lines)
