"""Weight pushes of SmolLM2-135M-Instruct into real SGLang engines, per format, side by side in one run (CPU here;
pass --device cuda on a GPU):

  bf16     a BF16 push into a BF16 engine (the reference): new tensors each push, as a trainer's export makes
           them (on a host the trainer's fp32 parameters are cast to BF16 for every push), so sending them
           copies them into shared memory
  bf16-shm the same, pushing the previous push's tensors again: already in shared memory, sending them copies
           nothing; a lower bound that no export reaches on a host
  requant  a BF16 push into a quantized engine that keeps full-precision masters and re-quantizes them
           (`push: bf16`, re-quantizer `--requant`)
  codes    a code push (`push: codes`): the trainer quantizes each unit once (`qurl_mcore.rollout.codes`, with
           the same `--requant` quantizer; timed as part of the push) and the engine installs the codes in place,
           with no masters

Every push but `bf16-shm` sends new tensors, made before the clock starts. A push is the whole update session
(begin_weight_update, update_weights_from_tensor per 512 MiB bucket, end_weight_update, the version check),
median of `--repeats` after a warm-up push; `trainer s` is the part of it that makes the buckets (a code push's
quantization, digests and packing); `wire MiB` is what the buckets carry; `/ bf16` is the ratio to the `bf16`
row. `masters MiB` is what an engine holds beside its codes (the full-precision copy of every quantized
weight), `RSS MiB` the resident memory of the engine's processes after the pushes (host memory; the weights of
a GPU engine are in device memory instead, masters in pinned host memory). Scope "all": every linear quantized.

Usage: python benchmarks/weight_push.py [--repeats 3] [--device cpu] [--formats int8 fp8_e4m3 nvfp4 mxfp4]
"""
from __future__ import annotations

import argparse
import statistics
import time

#: format -> the qurl method that runs it
FORMATS = {"int8": "qurl_int8", "fp8_e4m3": "qurl_fp8", "nvfp4": "qurl_fp4", "mxfp4": "qurl_fp4"}
PUSHES = ("requant", "codes")
BUCKET = 512 << 20


def measure(path: str, tensors: list, method: str | None, options: dict, device: str, repeats: int,
            new: bool = True) -> dict:
    """Median push seconds (and of them the trainer's), wire bytes, masters bytes and engine RSS of one engine;
    `new`: push new copies of the tensors each time (made before the clock starts), else `tensors` themselves."""
    import psutil

    from qurl_mcore.recipe import engine_recipe
    from qurl_mcore.rollout import EngineConfig, LocalEngine
    from qurl_mcore.rollout.codes import CodePush, engine_units
    from qurl_mcore.sglang.options import REQUANTS
    from qurl_mcore.transfer import buckets, nbytes

    config = EngineConfig(path, method, options, device=device, mem_fraction_static=0.2, max_total_tokens=4096,
                          context_length=1024, extra={"skip_tokenizer_init": True})
    recipe = engine_recipe(method, options["fmt"], options["scope"]) if method else None
    units = engine_units(path, recipe.groups) if recipe else {}
    codes = options.get("push") == "codes"
    with LocalEngine(config) as engine:
        times, made, wire = [], [], 0
        for i in range(repeats + 1):  # the first push warms up
            pushed = [(n, t.clone()) for n, t in tensors] if new else tensors
            start = time.perf_counter()
            stream = buckets(pushed, BUCKET)
            if codes:
                stream = CodePush(recipe.spec, units, quantizer=REQUANTS[options["requant"]]).buckets(stream)
            sent = [nt for bucket in stream for nt in bucket]
            made.append(time.perf_counter() - start)
            engine.push_weights(sent, version=f"bench-{i}", bucket_bytes=BUCKET)
            times.append(time.perf_counter() - start)
            wire = sum(nbytes(t) for _, t in sent)
            del pushed, sent
        rss = sum(psutil.Process(pid).memory_info().rss for pid in engine._processes)
    masters = 0 if codes or not method else sum(nbytes(t) for n, t in tensors if n in units)
    return {"s": statistics.median(times[1:]), "trainer": statistics.median(made[1:]), "wire": wire,
            "masters": masters, "rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requant", default="eager", choices=("eager", "compiled"))
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    args = parser.parse_args()

    from safetensors.torch import load_file

    from qurl_mcore.models.smollm2 import hf_checkpoint

    path = str(hf_checkpoint())
    tensors = list(load_file(f"{path}/model.safetensors").items())
    mib = 1 << 20
    print(f"{'push':8s} {'fmt':9s} {'push s':>7s} {'/ bf16':>7s} {'trainer s':>9s} {'wire MiB':>9s} {'/ bf16':>7s} "
          f"{'masters MiB':>12s} {'RSS MiB':>8s}", flush=True)
    base = None
    for push, fmt in [("bf16", ""), ("bf16-shm", "")] + [(push, fmt) for fmt in args.formats for push in PUSHES]:
        options = {"fmt": fmt, "scope": "all", "requant": args.requant,
                   "push": "codes" if push == "codes" else "bf16"} if fmt else {}
        m = measure(path, tensors, FORMATS.get(fmt), options, args.device, args.repeats, new=push != "bf16-shm")
        base = base or m
        print(f"{push:8s} {fmt:9s} {m['s']:7.3f} {m['s'] / base['s']:7.2f} {m['trainer']:9.3f} {m['wire'] / mib:9.1f} "
              f"{m['wire'] / base['wire']:7.2f} {m['masters'] / mib:12.1f} {m['rss'] / mib:8.0f}", flush=True)


if __name__ == "__main__":
    main()
