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

Usage: python benchmarks/rollout_kernels.py [--device cpu|cuda] [--quick]
"""
from __future__ import annotations

import argparse
import functools
import itertools

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (a check that the script runs)")
    args = ap.parse_args()
    torch.manual_seed(0)
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
    else:
        print("graphs: skipped (CUDA graphs need a GPU)")


if __name__ == "__main__":
    main()
