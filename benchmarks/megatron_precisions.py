"""Forward+backward time of a tiny Megatron MoE GPT per precision's trainer side, as a ratio to `bf16`, measured
side by side in one run (lower is cheaper). One model per distinct trainer side of `qurl_mcore.precision`
(int8/fp8 train in full precision like bf16). On CPU the quantized ones run the `qurl_mcore.quant` emulation,
so the ratios measure the emulation's overhead, not FP4/FP8 kernel speed.

The model is the tiny random Qwen3-MoE shape (2 layers, hidden 128, 4 experts top-2, 64-wide experts) with
a 1024-token vocabulary so that the output layer does not dominate. Models are timed round-robin, so a
slow spell of the machine hits all of them alike.

Usage: python benchmarks/megatron_precisions.py [--scope experts|all] [--fmt nvfp4|mxfp4|hif4] [--batch 4] [--seq 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qurl_mcore.megatron.gpt import gpt_config
from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel
from qurl_mcore.megatron.spec import gpt_spec
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import FP4_FORMATS, PRECISIONS
from qurl_mcore.recipe import resolve

VOCAB = 1024


def build(config, precision: str, scope: str, fmt: str | None):
    from megatron.core.models.gpt import GPTModel

    fmt = fmt if fmt in PRECISIONS[precision].formats else None
    return GPTModel(config=config, transformer_layer_spec=gpt_spec(config, resolve(precision, scope, fmt)),
                    vocab_size=VOCAB, max_sequence_length=4096, position_embedding_type="rope")


def step(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, labels=ids)
    loss.mean().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scope", default="experts", choices=["experts", "all"])
    ap.add_argument("--fmt", default="nvfp4", choices=FP4_FORMATS)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    init_parallel()
    torch.manual_seed(0)
    config = gpt_config(tiny_checkpoint("qwen3_moe"))
    # one model per distinct trainer side (mode, granularity)
    sides = {}
    for p in PRECISIONS.values():
        sides.setdefault((p.train, p.train_granularity), p.name)
    models = {name: build(config, name, args.scope, args.fmt) for name in sides.values()}
    ids = torch.randint(0, VOCAB, (args.batch, args.seq))
    times: dict[str, list[float]] = {r: [] for r in models}
    for model in models.values():
        step(model, ids)  # warm-up
    for _ in range(args.repeats):
        for name, model in models.items():
            t = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["bf16"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Qwen3-MoE, scope={args.scope}, "
          f"fmt={args.fmt} (fp4 rows), fp8_e4m3 per tensor (fp8_e2e); batch {args.batch} x {args.seq} tokens")
    print(f"{'precision':<18}{'trainer mode':<14}{'fwd+bwd ms':>12}{'/ bf16':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<18}{PRECISIONS[name].train:<14}{med * 1e3:>12.1f}{med / base:>9.2f}")
    destroy_parallel()


if __name__ == "__main__":
    main()
