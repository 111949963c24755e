"""Trainer-step benchmarks, each comparing two variants side by side in one run.

Revisions: the CPU demo's trainer step, this checkout against an older revision: seconds per step (median) at
world size 1, and peak resident memory per rank at world size 2 (DP = 2), on SmolLM2-135M with the demo's config
(launch/configs/cpu_demo.yaml of each revision) and a batch shaped like the demo's (8 prompts x 6 samples,
~45-token prompts, 6-token responses). The older revision is checked out into a temporary git worktree and
imported from there; each measurement runs in a fresh process, the two revisions alternating, so a slow spell of
the machine hits both alike.

Experts (`--experts`): the forward and backward of a random Qwen3-MoE (`EXPERT_SHAPES`: a tiny one with 64
experts on the CPU; one layer at Qwen3-30B-A3B's expert shapes for the GPU check) with grouped experts and with
SequentialMLP, alternating in one process on the same weights and tokens, per precision: seconds (median) and
the sequential/grouped ratio.

Usage: python benchmarks/trainer_step.py [--old REV] [--repeats 3]   (default REV: e647878, before the
trainer moved to Megatron's DDP/optimizer/schedules)
       python benchmarks/trainer_step.py --experts [--shape tiny-64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_batch():
    import torch

    from qurl_mcore.loop.batch import Sample, collate

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(48):
        prompt = torch.randint(3, 49000, (40 + i % 8,), generator=g).tolist()
        response = torch.randint(3, 49000, (6,), generator=g).tolist()
        samples.append(Sample(prompt, response, [-1.0] * 6, group=i // 6))
    return collate(samples, torch.randn(48, generator=g), pad_id=0)


def _trainer(tree: str, rank: int = 0, world_size: int = 1, *overrides: str):
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer

    cfg = load_config(Path(tree) / "launch/configs/cpu_demo.yaml", ["train.threads=2", *overrides])
    return PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)


def time_steps(tree: str, steps: int) -> list[float]:
    import time

    trainer = _trainer(tree)
    batch = demo_batch()
    trainer.step(batch)  # warm-up
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(batch)
        out.append(time.perf_counter() - start)
    trainer.close()
    return out


def peak_rss(tree: str, rank: int) -> float:
    """Peak resident memory (GiB) of DP=2 rank `rank` through one step (RANK/WORLD_SIZE/MASTER_* set)."""
    import resource

    trainer = _trainer(tree, rank, 2, "train.dp_size=2")
    trainer.step(demo_batch())
    trainer.close()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _start(tree: str, call: str, env: dict | None = None) -> subprocess.Popen:
    """`call` in a fresh interpreter that imports qurl_mcore from `tree`: the editable install's import hook
    (which would pick this checkout whatever sys.path says) is taken out first."""
    code = ("import json, sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith('__editable__')]; "
            f"sys.path[:0] = [{tree!r}, {str(ROOT / 'benchmarks')!r}]; import trainer_step as b; "
            f"print(json.dumps({call}))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _result(process: subprocess.Popen, tree: str) -> object:
    out, err = process.communicate(timeout=1800)
    if process.returncode:
        raise RuntimeError(f"{tree}: {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _times(tree: str, steps: int) -> list[float]:
    return _result(_start(tree, f"b.time_steps({tree!r}, {steps})"), tree)


def _rss(tree: str) -> list[float]:
    from qurl_mcore.transfer import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [_start(tree, f"b.peak_rss({tree!r}, {rank})", {**env, "RANK": str(rank)}) for rank in range(2)]
    return [_result(p, tree) for p in ranks]


#: name -> (Qwen3-MoE config fields, tokens per pass): the CPU's tiny MoE and Qwen3-30B-A3B's expert shapes
#: (hidden 2048, 128 experts of 768, top-8) in one layer with a small vocabulary
EXPERT_SHAPES = {
    "tiny-64": (dict(hidden_size=128, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=8,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=256, vocab_size=1000), 512),
    "qwen3-30b-a3b": (dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           intermediate_size=6144, vocab_size=1000), 4096),
}


def experts_seconds(shape: str, precisions: tuple[str, ...] = ("bf16", "fp4_rc"), repeats: int = 3,
                    device: str = "cpu") -> dict[str, dict[str, float]]:
    """precision -> {"grouped", "sequential": median seconds of a forward + backward} for `EXPERT_SHAPES[shape]`
    (Megatron initialised here at world size 1; the two models share their weights)."""
    import time

    import torch
    from transformers import AutoConfig

    from qurl_mcore.megatron.gpt import build_gpt
    from qurl_mcore.megatron.logprobs import token_logprobs
    from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel
    from qurl_mcore.megatron.spec import EXPERT_MODULES
    from qurl_mcore.recipe import resolve

    fields, tokens = EXPERT_SHAPES[shape]
    hf = AutoConfig.for_model("qwen3_moe", max_position_embeddings=4096, **fields)
    ids = torch.randint(3, fields["vocab_size"], (tokens // 512, 512), generator=torch.Generator().manual_seed(0))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    init_parallel()
    out = {}
    try:
        for precision in precisions:
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            models = {kind: build_gpt(hf, recipe=resolve(precision), dtype=dtype, experts=kind)
                      for kind in EXPERT_MODULES}
            models["sequential"].load_state_dict(models["grouped"].state_dict())
            times = {kind: [] for kind in models}
            for i in range(repeats + 1):  # the first round warms up
                for kind, model in models.items():
                    sync()
                    start = time.perf_counter()
                    token_logprobs(model, ids.to(device), grad=True).logprobs.sum().backward()
                    sync()
                    if i:
                        times[kind].append(time.perf_counter() - start)
            out[precision] = {kind: statistics.median(t) for kind, t in times.items()}
            del models
    finally:
        destroy_parallel()
    return out


def experts_report(shape: str, results: dict[str, dict[str, float]]) -> str:
    fields, tokens = EXPERT_SHAPES[shape]
    return (f"{shape} ({fields['num_experts']} experts, top-{fields['num_experts_per_tok']}, {tokens} tokens), "
            "forward + backward, sequential/grouped: " + ", ".join(
                f"{p} {r['sequential']:.3f}/{r['grouped']:.3f} s = x{r['sequential'] / r['grouped']:.2f}"
                for p, r in results.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="e647878")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", action="store_true", help="grouped vs sequential experts (module docstring)")
    parser.add_argument("--shape", default="tiny-64", choices=list(EXPERT_SHAPES))
    args = parser.parse_args()
    if args.experts:
        print(experts_report(args.shape, experts_seconds(args.shape, repeats=args.repeats)))
        return
    with tempfile.TemporaryDirectory(prefix="qurl-old-") as tmp:
        old = str(Path(tmp) / "tree")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", old, args.old], check=True)
        try:
            times = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, tree in (("old", old), ("new", str(ROOT))):
                    times[name] += _times(tree, 2)
            rss = {name: _rss(tree) for name, tree in (("old", old), ("new", str(ROOT)))}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", old], check=False)
    t_old, t_new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"trainer step, CPU demo batch (48 x ~52 tokens), SmolLM2-135M, 2 threads; old = {args.old}")
    print(f"  seconds per step (median of {len(times['new'])}): old {t_old:.2f}, new {t_new:.2f}, "
          f"new/old {t_new / t_old:.2f}")
    print(f"  peak RSS per rank at DP=2 (GiB): old {max(rss['old']):.2f}, new {max(rss['new']):.2f}, "
          f"new/old {max(rss['new']) / max(rss['old']):.2f}")


if __name__ == "__main__":
    main()
