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
