"""One full weight push of SmolLM2-135M-Instruct into a real SGLang engine, per qurl method, as a ratio to
the same push into a BF16 engine, measured in one run (CPU here; pass --device cuda on a GPU).

A push is the whole update session: begin_weight_update (quantized layers re-attach their full-precision
weights), update_weights_from_tensor of every checkpoint tensor in 512 MiB buckets, end_weight_update
(re-quantization with qurl_mcore.quant, eager or compiled: the `requant` option), and the weight-version check.
A compiled engine compiles when it loads, so the timed pushes (after one warm-up push) do not include it.

Usage: python benchmarks/weight_push.py [--repeats 3] [--device cpu] [--methods qurl_int8 qurl_fp8 ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

from qurl_mcore.precision import METHODS as QURL_METHODS
from qurl_mcore.sglang.options import REQUANTS

#: a BF16 engine, then every qurl method in every format it takes (scope all: every linear re-quantizes), with
#: each re-quantizer (`requant`: eager, compiled)
METHODS = [(None, {})] + [(m.name, {"fmt": fmt, "scope": "all", "requant": r}) for r in REQUANTS
                          for m in QURL_METHODS.values() for fmt in m.formats]


def push_seconds(method, options, device: str, repeats: int) -> float:
    from safetensors.torch import load_file

    from qurl_mcore.models.smollm2 import hf_checkpoint
    from qurl_mcore.rollout import EngineConfig, LocalEngine

    path = str(hf_checkpoint())
    tensors = list(load_file(f"{path}/model.safetensors").items())
    config = EngineConfig(path, method, options, device=device, mem_fraction_static=0.2, max_total_tokens=4096,
                          context_length=1024)
    with LocalEngine(config) as engine:
        times = []
        for i in range(repeats + 1):  # the first push warms up
            t = time.perf_counter()
            engine.push_weights(tensors, version=f"bench-{i}")
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="*", help="qurl methods to compare with bf16 (default: all)")
    args = parser.parse_args()
    rows = []
    for method, options in METHODS:
        if method is not None and args.methods and method not in args.methods:
            continue
        rows.append((method or "bf16", options.get("fmt", ""), options.get("requant", ""),
                     push_seconds(method, options, args.device, args.repeats)))
    base = rows[0][3]
    print(f"{'method':12s} {'fmt':9s} {'requant':9s} {'push s':>8s} {'/ bf16':>7s}")
    for method, fmt, requant, sec in rows:
        print(f"{method:12s} {fmt:9s} {requant:9s} {sec:8.3f} {sec / base:7.2f}")


if __name__ == "__main__":
    main()
