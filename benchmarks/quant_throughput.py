"""Quantization throughput, as ratios measured side by side in one run (lower is cheaper):

  quantize+dequantize of a 4096x4096 fp32 tensor, per format and granularity  /  a plain tensor copy
      eager (the reference) and compiled (torch.compile, fullgraph: the fused path; the values where it
      differs from eager are counted: 0 unless inductor changes the numerics)
  RC linear forward+backward (per mode)                                      /  a plain fp32 linear

Usage: python benchmarks/quant_throughput.py [--device cpu|cuda] [--size 4096] [--tokens 1024] [--repeats 5]
(the GPU check runs the first table on its GPU: benchmarks/device_check.py)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qurl_mcore.quant import FORMATS, make_spec, quant_linear, quantize

CASES = [("int8", "token"), ("int8", "block"), ("fp8_e4m3", "token"), ("fp8_e4m3", "block"),
         ("fp8_e5m2", "token"), ("nvfp4", "block"), ("mxfp4", "block")]


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of `fn` after one warm-up call, waiting for the GPU's queued work each time."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def quantize_ratios(size: int, repeats: int, device: str = "cpu"
                    ) -> tuple[float, list[tuple[str, str, float, float, int]]]:
    """(copy seconds, [(format, granularity, eager / copy, compiled / copy, values where compiled differs
    from eager)]) for quantize+dequantize of a [size, size] fp32 tensor on `device` (0 differing: bitwise
    equal, as it must be)."""
    x = torch.randn(size, size, device=device)
    base = median_seconds(lambda: x.clone(), repeats)
    rows = []
    for fmt, gran in CASES:
        assert fmt in FORMATS
        eager = lambda t, fmt=fmt, gran=gran: quantize(t, fmt, gran).dequantize()  # noqa: E731
        fused = torch.compile(eager, fullgraph=True)
        differ = int((fused(x) != eager(x)).sum())
        rows.append((fmt, gran, median_seconds(lambda: eager(x), repeats) / base,
                     median_seconds(lambda: fused(x), repeats) / base, differ))
    return base, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    base, rows = quantize_ratios(args.size, args.repeats, args.device)
    print(f"\nquantize+dequantize {args.size}x{args.size} on {args.device} (baseline: copy = {base * 1e3:.1f} ms)")
    print(f"{'format':<10} {'granularity':<12} {'eager ms':>9} {'x copy':>7} {'compiled ms':>12} {'x copy':>7} "
          f"{'differ':>7}")
    for fmt, gran, eager, fused, differ in rows:
        print(f"{fmt:<10} {gran:<12} {eager * base * 1e3:>9.1f} {eager:>6.1f}x {fused * base * 1e3:>12.1f} "
              f"{fused:>6.1f}x {differ:>7}")

    a = torch.randn(args.tokens, args.hidden, device=args.device, requires_grad=True)
    w = torch.randn(args.hidden, args.hidden, device=args.device, requires_grad=True)
    g = torch.randn(args.tokens, args.hidden, device=args.device)

    def fwd_bwd(spec=None):
        y = torch.nn.functional.linear(a, w) if spec is None else quant_linear(a, w, spec=spec)
        y.backward(g)

    base = median_seconds(fwd_bwd, args.repeats)
    print(f"\nlinear forward+backward [{args.tokens}x{args.hidden}] x [{args.hidden}x{args.hidden}] "
          f"(baseline: plain fp32 linear = {base * 1e3:.1f} ms)")
    print(f"{'mode':<14} {'format':<10} {'ms':>8} {'x plain':>8}")
    for mode, fmt in [("bf16", None), ("rc_none", "int8"), ("rc_none", "fp8_e4m3"), ("rc_none", "nvfp4"),
                      ("rc_forward", "nvfp4"), ("rc_backward", "nvfp4"), ("rc_both", "nvfp4"),
                      ("rc_both", "mxfp4"), ("rc_both", "hif4")]:
        spec = make_spec(mode, fmt)
        t = median_seconds(lambda: fwd_bwd(spec), args.repeats)
        print(f"{mode:<14} {fmt or '-':<10} {t * 1e3:>8.1f} {t / base:>7.1f}x")


if __name__ == "__main__":
    main()
