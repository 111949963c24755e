"""The CPU demo's trainer step, this checkout against an older revision, measured side by side in one run:
seconds per step (median) at world size 1, and peak resident memory per rank at world size 2 (DP = 2), on
SmolLM2-135M with the demo's config (launch/configs/cpu_demo.yaml of each revision) and a batch shaped like
the demo's (8 prompts x 6 samples, ~45-token prompts, 6-token responses).

The older revision is checked out into a temporary git worktree and imported from there; each measurement
runs in a fresh process, the two revisions alternating, so a slow spell of the machine hits both alike.

Usage: python benchmarks/trainer_step.py [--old REV] [--repeats 3]   (default REV: e647878, before the
trainer moved to Megatron's DDP/optimizer/schedules)
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
    return PolicyTrainer(cfg, rank=rank, world_size=world_size)


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


def peak_rss(rank: int, tree: str) -> float:
    """Peak resident memory (GiB) of a DP=2 rank through one step."""
    import resource

    trainer = _trainer(tree, rank, 2, "train.dp_size=2")
    trainer.step(demo_batch())
    trainer.close()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _run(tree: str, what: str, arg: int) -> object:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import trainer_step as b; "
            + (f"print(json.dumps(b.time_steps({tree!r}, {arg})))" if what == "time" else
               f"from qurl_mcore.megatron.parallel import spawn; print(json.dumps(spawn(b.peak_rss, 2, {tree!r})))"))
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="e647878")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qurl-old-") as tmp:
        old = str(Path(tmp) / "tree")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", old, args.old], check=True)
        try:
            times = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, tree in (("old", old), ("new", str(ROOT))):
                    times[name] += _run(tree, "time", 2)
            rss = {name: _run(tree, "rss", 0) for name, tree in (("old", old), ("new", str(ROOT)))}
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
