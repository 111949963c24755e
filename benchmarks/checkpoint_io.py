"""Trainer checkpoints, torch_dist (Megatron's distributed checkpoint, synchronous and written in the background)
against torch (one file per rank), measured side by side in one run: seconds to save and to load, the seconds
training waits for a save (the stall), and peak memory above the trainer's own while saving and loading, per
rank, at world size 2 (DP = 2: the fully parallel save spreads the replicated state over both
ranks), on SmolLM2-135M and the tiny MoE (tiny-qwen3_moe), fp32 on the CPU, after one optimizer step (Adam's
moments exist).

Each measurement runs in fresh processes, the variants alternating, so a slow spell of the machine hits each
alike. Save: `PolicyTrainer.save_checkpoint` (writing, fsync and the SHA-256 of every file; in the background,
checkpoint.async_save, until `finish_checkpoint` returns) and `finalize` on rank 0; stall: the seconds until
`save_checkpoint` returns and training could go on; load: `PolicyTrainer.load_checkpoint` of the published
checkpoint. Memory: resident set size sampled every 2 ms, its peak during the call minus its value before (the
process's own: a background save's forked writer is not counted).

Usage: python benchmarks/checkpoint_io.py [--models smollm2,tiny-qwen3_moe] [--repeats 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> its checkpoint settings; the first is the baseline ("old") the others are compared with
VARIANTS = {"torch": ["checkpoint.format=torch"], "torch_dist": ["checkpoint.format=torch_dist"],
            "torch_dist_async": ["checkpoint.format=torch_dist", "checkpoint.async_save=true"]}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@contextmanager
def _measured(out: dict, name: str):
    """Record the seconds the block takes (`name`_s) and its peak RSS above the start (`name`_mb)."""
    base, peak, done = _rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        out[f"{name}_s"] = time.perf_counter() - start
        done.set()
        thread.join()
        out[f"{name}_mb"] = max(peak[0], _rss_mb()) - base


def measure(rank: int, world_size: int, model: str, variant: str, root: str) -> dict:
    """One rank: a step, a save with `variant`'s settings (published by rank 0), a load of it; its times and
    memory."""
    import torch.distributed as dist

    from qurl_mcore import checkpoint as ckpt
    from qurl_mcore.config import load_config, to_dict
    from qurl_mcore.loop.trainer import PolicyTrainer
    from tests.loop.workers import batch

    cfg = load_config(None, [f"model.path={model}", f"train.dp_size={world_size}", *VARIANTS[variant],
                             "uaq.enabled=false", "precision=bf16", "train.threads=1", "train.micro_batch_size=4"])
    trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)
    out: dict = {}
    try:
        trainer.step(batch(moe=trainer.moe))
        dist.barrier()
        with _measured(out, "save"):
            start = time.perf_counter()
            files = trainer.save_checkpoint(root, 1)
            out["stall_s"] = time.perf_counter() - start
            files += trainer.finish_checkpoint()
            every = [None] * world_size
            dist.all_gather_object(every, files)
            if rank == 0:
                ckpt.finalize(root, 1, [r for f in every for r in f],
                              {"format": cfg.checkpoint.format, "world_size": world_size, "config": to_dict(cfg)})
            dist.barrier()
        with _measured(out, "load"):
            trainer.load_checkpoint(str(ckpt.step_dir(root, 1)))
            dist.barrier()
        out["bytes"] = sum(r["bytes"] for r in ckpt.read_meta(ckpt.step_dir(root, 1))["files"])
    finally:
        trainer.close()
    return out


def main() -> None:
    from qurl_mcore.megatron.parallel import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,tiny-qwen3_moe")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    old, *new = VARIANTS
    print(f"trainer checkpoint, world size 2 (DP=2), fp32 on the CPU, 1 thread per rank; old = {old} (per-rank "
          "files); per rank: median over repeats, the slower rank")
    for model in args.models.split(","):
        runs: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory(prefix="qurl-ckpt-bench-") as tmp:
                    runs[variant].append(spawn(measure, 2, 2, model, variant, tmp))

        def value(variant: str, key: str) -> float:
            return statistics.median(max(rank[key] for rank in run) for run in runs[variant])

        sizes = ", ".join(f"{v} {runs[v][0][0]['bytes'] / 2**20:.0f} MiB" for v in VARIANTS)
        print(f"{model}: checkpoint {sizes}")
        for key, unit in (("save_s", "s"), ("stall_s", "s"), ("load_s", "s"), ("save_mb", "MiB peak"),
                          ("load_mb", "MiB peak")):
            base = value(old, key)
            cells = ", ".join(f"{v} {value(v, key):8.2f} ({value(v, key) / max(base, 1e-9):.2f}x)" for v in new)
            print(f"  {key.split('_')[0]:5} {unit:>8}: {old} {base:8.2f}, {cells}")


if __name__ == "__main__":
    main()
