"""The rollout engine's kernels on one device, as ratios measured side by side (the rollout sections of the
GPU check, benchmarks/device_check.py; they run on the CPU too, where every quantized GEMM is emulated):

  decode    Y = Q(X)·Q(W)ᵀ by `quantized_linear` (W8A8: per-token X, per-channel W, the GEMM `auto` picks:
            torch._int_mm / torch._scaled_mm on CUDA; an engine on CUDA runs SGLang's fused kernels instead,
            `sglang.kernels`, unless `kernel: emulated`) against a bf16 linear, at decode batches M and the
            projection shapes [in, out] of 7B and 32B models, eager and (CUDA) replayed from CUDA graphs as
            SGLang decodes; > 1: faster than bf16
  requant   re-quantizing every quantized linear of Qwen2.5-7B (what an engine does after a push: eager
            `quantize_weight` or, with `requant: compiled`, `quantize_weight_compiled`; compiling is not
            timed) against copying the same bf16 weights on the device (what the push itself does)
  graphs    each rollout method's linear (INT8, FP8, NVFP4, MXFP4, RC of both) captured in a CUDA graph, then
            replayed on new input and after an in-place refit (`sglang.weights.store`), and its emulated MoE
            experts (`quant.experts`) on new input and routing: equal to eager bitwise
  fp4 moe   the FP4 MoE kernels (`qurl_mcore.kernels`: NVFP4, MXFP4, RC on and off) against a BF16 fused MoE
            (SGLang's Triton kernel where SGLang is installed, else torch's grouped GEMM over the same routed
            slots) at Qwen3-30B-A3B's and GLM-4.5's expert shapes (one GPU's: TP 1), batches 1, 8, 64, 256,
            both replayed from CUDA graphs: bf16 time / FP4 time (> 1: faster), and each kernel's largest error
            against the emulation (`experts_forward`) relative to its largest output. On the CPU the kernels
            run under Triton's interpreter (bf16 corrected as tests/kernels/interpreter.py does), for
            correctness only, at shapes divided by 16 and batch 1 and 8 (every shape with --full)

Usage: python benchmarks/rollout_kernels.py [--device cpu|cuda] [--quick] [--full]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import sys

import torch
from quant_throughput import median_seconds

from qurl_mcore.quant import quantize_weight
from qurl_mcore.quant.linear import quantized_linear
from qurl_mcore.recipe import engine_recipe
from qurl_mcore.sglang.options import REQUANTS

DECODE_SHAPES = ((4096, 4096), (4096, 11008), (5120, 27648))  # [in, out]: 7B attention, 7B MLP, 32B MLP
DECODE_BATCHES = (1, 16, 128)
GRAPH_METHODS = (("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"), ("qurl_fp4", "mxfp4"),
                 ("qurl_fp4_rc", "nvfp4"), ("qurl_fp4_rc", "mxfp4"))


def decode_speedups(device: str, shapes=DECODE_SHAPES, batches=DECODE_BATCHES, repeats: int = 20, *,
                    graphed: bool = False) -> dict[tuple[str, int, int, int], float]:
    """{(format, M, in, out): bf16 linear time / quantized linear time} for INT8 and FP8 E4M3. `graphed`
    (CUDA): both replayed from CUDA graphs, as SGLang runs decode, so kernel launches cost nothing: what is
    left is the kernels' own time (the per-token quantization's small kernels and the GEMM)."""
    out = {}
    for k, n in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for fmt, method in (("int8", "qurl_int8"), ("fp8_e4m3", "qurl_fp8")):
            spec = engine_recipe(method, fmt).spec
            wq = quantize_weight(w, spec)
            for m in batches:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                linears = (lambda x: torch.nn.functional.linear(x, w), lambda x: quantized_linear(x, wq, None, spec))
                plain, quant = (_captured(f, x)[0].replay if graphed else functools.partial(f, x) for f in linears)
                out[(fmt, m, k, n)] = median_seconds(plain, repeats) / median_seconds(quant, repeats)
    return out


def qwen25_7b_linears() -> list[tuple[int, int]]:
    """The [out, in] shapes of Qwen2.5-7B's quantized linears (scope all: attention and MLP), from its card."""
    from qurl_mcore.models.cards import card
    from qurl_mcore.models.registry import shape
    from qurl_mcore.sizing import hf_tensors

    return [t.shape for t in hf_tensors(shape(card("Qwen2.5-7B"))) if t.kind in ("attention", "mlp")
            and len(t.shape) == 2]


def requant_ratios(device: str, shapes: list[tuple[int, int]],
                   formats=(("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4")),
                   repeats: int = 3) -> tuple[float, dict[str, float]]:
    """(seconds to copy the weight set, {"format requant": re-quantize time / copy time}) for each engine
    re-quantizer (`REQUANTS`). One bf16 source per distinct shape serves every tensor of that shape (each is far
    larger than any cache), so the set needs no more memory than its largest tensors."""
    sources = {s: torch.randn(s, device=device, dtype=torch.bfloat16) for s in set(shapes)}
    targets = {s: torch.empty_like(t) for s, t in sources.items()}

    def copy_all():
        for s in shapes:
            targets[s].copy_(sources[s])

    base = median_seconds(copy_all, repeats)
    ratios = {}
    for (method, fmt), (requant, quantizer) in itertools.product(formats, REQUANTS.items()):
        spec = engine_recipe(method, fmt).spec
        ratios[f"{fmt} {requant}"] = median_seconds(lambda: [quantizer(sources[s], spec) for s in shapes],
                                                    repeats) / base
    return base, ratios


def _captured(fn, *static):
    """`fn(*static)` captured in a CUDA graph (warmed up off the capture stream, as torch's recipe asks):
    (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph, out


def graph_replays(device: str = "cuda", shape=(4096, 4096), batch: int = 16, experts: int = 8
                  ) -> dict[str, bool]:
    """{method/format (linear | experts): captured replays equal eager bitwise}: a linear on new input and
    after an in-place refit (`sglang.weights.store`), and an MoE layer's experts (`quant.experts`, E experts
    of [2·1024, 1024] and [1024, 1024], top-2) on new input and new routing."""
    from qurl_mcore.quant.experts import experts_forward
    from qurl_mcore.sglang.weights import stack, store

    k, n = shape
    results = {}
    for method, fmt in GRAPH_METHODS:
        spec = engine_recipe(method, fmt).spec
        wq = quantize_weight(torch.randn(n, k, device=device, dtype=torch.bfloat16), spec)
        x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
        graph, y = _captured(lambda x: quantized_linear(x, wq, None, spec), x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        same_input = torch.equal(y, quantized_linear(x, wq, None, spec))
        refit = store(wq, quantize_weight(torch.randn(n, k, device=device, dtype=torch.bfloat16), spec))
        graph.replay()
        same_refit = refit is wq and torch.equal(y, quantized_linear(x, wq, None, spec))
        results[f"{method}/{fmt} linear"] = same_input and same_refit

        w13, _ = stack([quantize_weight(torch.randn(2048, 1024, device=device) / 32, spec) for _ in range(experts)])
        w2, _ = stack([quantize_weight(torch.randn(1024, 1024, device=device) / 32, spec) for _ in range(experts)])
        h = torch.randn(batch, 1024, device=device, dtype=torch.bfloat16)
        p = torch.rand(batch, 2, device=device)
        ids = torch.randint(0, experts, (batch, 2), device=device, dtype=torch.int32)
        graph, out = _captured(lambda h, p, ids: experts_forward(h, p, ids, w13, w2, spec), h, p, ids)
        h.copy_(torch.randn_like(h))
        p.copy_(torch.rand_like(p))
        ids.copy_(torch.randint(0, experts, ids.shape, device=device, dtype=torch.int32))
        graph.replay()
        results[f"{method}/{fmt} experts"] = torch.equal(out, experts_forward(h, p, ids, w13, w2, spec))
    return results


#: model -> (hidden, expert intermediate, experts, top-k), from their cards
MOE_SHAPES = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "GLM-4.5": (5120, 1536, 160, 8)}
MOE_BATCHES = (1, 8, 64, 256)
MOE_METHODS = (("qurl_fp4", "nvfp4"), ("qurl_fp4_rc", "nvfp4"), ("qurl_fp4", "mxfp4"), ("qurl_fp4_rc", "mxfp4"))


def moe_weights(model: str, device: str, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One MoE layer's bf16 expert weights at `model`'s shape (each dimension / `scale`, experts too):
    W13 [E, 2I, H], W2 [E, H, I], and the top-k."""
    hidden, inter, experts, k = MOE_SHAPES[model]
    hidden, inter, experts = hidden // scale, inter // scale, max(k, experts // scale)
    g = torch.Generator(device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=g, dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device, generator=g, dtype=torch.bfloat16) / inter**0.5
    return w13, w2, k


def moe_inputs(batch: int, hidden: int, experts: int, k: int, device: str):
    """`batch` bf16 tokens and their routing: top-k of random scores, weights normalised over the k."""
    g = torch.Generator(device).manual_seed(batch)
    x = torch.randn(batch, hidden, device=device, generator=g, dtype=torch.bfloat16)
    p, ids = torch.rand(batch, experts, device=device, generator=g).topk(k, dim=1)
    return x, p / p.sum(1, keepdim=True), ids.to(torch.int32)


def sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def bf16_moe(x, p, ids, w13, w2, sglang: bool) -> torch.Tensor:
    """The BF16 fused MoE the FP4 kernels replace: `sglang`, SGLang's Triton kernel (gate/up GEMM, SiLU·up,
    down GEMM with the routing weight, sum over k), else torch's grouped GEMM over the same routed slots
    sorted by expert. Nothing reads the host: CUDA graphs capture either."""
    from qurl_mcore.kernels.align import align

    tokens, k = ids.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if sglang:
        import triton.language as tl
        from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel

        r = align(ids, experts, 16)
        config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
        h = x.new_empty(tokens, k, 2 * inter)
        invoke_fused_moe_kernel(x, w13, None, h, None, None, None, p, ids, r.sorted_ids, r.block_expert, r.padded,
                                False, k, config, tl.bfloat16, False, False, False, False, False)
        gate, up = h.view(-1, 2 * inter).chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).contiguous()
        y = x.new_empty(tokens, k, x.shape[1])
        invoke_fused_moe_kernel(act, w2, None, y, None, None, None, p, ids, r.sorted_ids, r.block_expert, r.padded,
                                True, 1, config, tl.bfloat16, False, False, False, False, False)
        return y.sum(1)
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm((torch.nn.functional.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
    y = torch.empty_like(y).index_copy_(0, order, y) * p.reshape(-1, 1).to(y.dtype)
    return y.view(tokens, k, -1).sum(1)


def fp4_moe_rows(device: str, batches=MOE_BATCHES, scale: int = 1, repeats: int = 20,
                 methods=MOE_METHODS) -> list[tuple[str, str, int, float | None, float]]:
    """[(model, method/fmt, batch, bf16 time / FP4 kernel time (None on the CPU), the kernel's largest error
    against `experts_forward` / the largest output)], both sides replayed from CUDA graphs on a GPU; the
    experts quantized and stacked as the engine holds them (`weights.stack`)."""
    from qurl_mcore.kernels.fp4_moe import fp4_experts
    from qurl_mcore.quant.experts import experts_forward
    from qurl_mcore.sglang.weights import stack

    rows = []
    for model in MOE_SHAPES:
        w13, w2, k = moe_weights(model, device, scale)
        for method, fmt in methods:
            spec = engine_recipe(method, fmt).spec
            q13, _ = stack([quantize_weight(w, spec) for w in w13])
            q2, _ = stack([quantize_weight(w, spec) for w in w2])
            for batch in batches:
                x, p, ids = moe_inputs(batch, w13.shape[2], w13.shape[0], k, device)
                out = fp4_experts(x, p, ids, q13, q2, spec)
                ref = experts_forward(x, p, ids, q13, q2, spec)
                error = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                ratio = None
                if device == "cuda":
                    fp4 = _captured(lambda x, p, ids: fp4_experts(x, p, ids, q13, q2, spec), x, p, ids)[0]
                    bf16 = _captured(lambda x, p, ids: bf16_moe(x, p, ids, w13, w2, sglang_installed()), x, p, ids)[0]
                    ratio = median_seconds(bf16.replay, repeats) / median_seconds(fp4.replay, repeats)
                rows.append((model, f"{method}/{fmt}", batch, ratio, error))
            del q13, q2
    return rows


def bf16_moe_errors(device: str, scale: int = 1) -> dict[str, float]:
    """{baseline: its largest error against bf16 torch ops slot by slot, relative to the largest output} at
    Qwen3-30B-A3B's shape (/ `scale`), batch 8: both baselines, SGLang's where it is installed."""
    w13, w2, k = moe_weights("Qwen3-30B-A3B", device, scale)
    x, p, ids = moe_inputs(8, w13.shape[2], w13.shape[0], k, device)
    ref = torch.zeros(x.shape, dtype=torch.float32, device=device)
    for t, j in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        gate, up = (x[t] @ w13[ids[t, j]].t()).chunk(2)
        ref[t] += p[t, j] * ((torch.nn.functional.silu(gate) * up) @ w2[ids[t, j]].t()).float()
    return {("sglang" if sglang else "grouped_mm"): float((bf16_moe(x, p, ids, w13, w2, sglang).float() - ref).abs().max()
                                                         / ref.abs().max())
            for sglang in ((True, False) if sglang_installed() else (False,))}


@contextlib.contextmanager
def interpreted():
    """The Triton kernels on the CPU: the interpreter on (before triton is imported) and its bf16 corrected."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before the interpreter was switched on: run the CPU check first")
    os.environ["TRITON_INTERPRET"] = "1"
    # the interpreter's corrections live with the tests (they change no GPU code): the repo root holds `tests`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.kernels.interpreter import corrected_bf16

    with corrected_bf16():
        yield


def print_fp4_moe(device: str, quick: bool, full: bool) -> None:
    if device == "cuda":
        rows, baselines = fp4_moe_rows(device, repeats=3 if quick else 20), bf16_moe_errors(device)
    else:
        scale = 1 if full else 32 if quick else 16
        with interpreted():
            rows = fp4_moe_rows(device, batches=MOE_BATCHES if full else (1,) if quick else (1, 8), scale=scale,
                                methods=MOE_METHODS[1::2] if quick else MOE_METHODS)
            baselines = bf16_moe_errors(device, scale)
    print(f"fp4 moe: bf16 fused MoE ({'sglang' if sglang_installed() else 'grouped_mm'}) time / FP4 kernel time "
          f"on {device}{' (CUDA graphs)' if device == 'cuda' else ' (interpreter: correctness only)'}; error vs "
          "emulation; bf16 baselines' error vs torch: " + ", ".join(f"{k} {v:.1e}" for k, v in baselines.items()))
    for model, method, batch, ratio, error in rows:
        speed = "" if ratio is None else f"  x{ratio:.2f}"
        print(f"  {model:<13} {method:<18} M={batch:<4}{speed}  error {error:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (a check that the script runs)")
    ap.add_argument("--full", action="store_true", help="CPU: the FP4 MoE kernels at full shapes (slow)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":  # first: the interpreter must be on before anything imports triton
        print_fp4_moe(args.device, args.quick, args.full)
    shapes = ((256, 256), (256, 688)) if args.quick else DECODE_SHAPES
    for graphed in (False, True) if args.device == "cuda" else (False,):
        print(f"decode: bf16 linear time / quantized linear time on {args.device}{' (CUDA graphs)' * graphed}")
        for (fmt, m, k, n), r in decode_speedups(args.device, shapes, repeats=3 if args.quick else 20,
                                                 graphed=graphed).items():
            print(f"  {fmt:<9} M={m:<4} [{k}, {n}]  x{r:.2f}")
    linears = qwen25_7b_linears()
    if args.quick:
        linears = [(o // 16, i // 16) for o, i in linears[:7]]
    base, ratios = requant_ratios(args.device, linears, repeats=1 if args.quick else 3)
    print(f"requant: {len(linears)} linears, copy {base * 1e3:.1f} ms; "
          + ", ".join(f"{fmt} x{r:.1f}" for fmt, r in ratios.items()))
    if args.device == "cuda":
        print("graphs: " + ", ".join(f"{m} {'equal' if ok else 'DIFFERS'}" for m, ok in graph_replays().items()))
        print_fp4_moe(args.device, args.quick, args.full)
    else:
        print("graphs: skipped (CUDA graphs need a GPU)")


if __name__ == "__main__":
    main()
