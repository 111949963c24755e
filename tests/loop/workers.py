"""Per-rank bodies of the trainer's multi-process tests (module-level, so that `spawn` imports them)."""
from __future__ import annotations

from pathlib import Path

import torch

from qurl_mcore.config import load_config
from qurl_mcore.loop.batch import Sample, collate
from qurl_mcore.loop.trainer import PolicyTrainer


def batch(seed: int = 0, rows: int = 8, moe: bool = False):
    """Prompts and responses of varied lengths with fixed advantages (PPO ignores the behaviour log-probs);
    for the tiny MoE (2 layers, top-2 of 4 experts) an engine's routing of every forwarded token, at random."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        p, r = 3 + i % 3, 2 + (i * 5) % 4
        ids = torch.randint(3, 1000, (p + r,), generator=g).tolist()
        routed = torch.rand(p + r - 1, 2, 4, generator=g).argsort(-1)[..., :2] if moe else None
        samples.append(Sample(ids[:p], ids[p:], [-1.0] * r, group=i // 2, routed_experts=routed))
    return collate(samples, torch.linspace(-1.0, 1.0, rows), pad_id=0)


def _hf(trainer: PolicyTrainer, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`values` (one tensor per parameter of this rank, e.g. its gradients) gathered into HF-named full
    tensors, through the same export the weight push uses."""
    from qurl_mcore.megatron import export_hf_weights

    params = dict(trainer.model.named_parameters())
    saved = {n: p.data for n, p in params.items()}
    try:
        for n, p in params.items():
            p.data = values[n]
        return {n: t.clone() for b in export_hf_weights(trainer.model, trainer.hf, bucket_bytes=1 << 30) for n, t in b}
    finally:
        for n, p in params.items():
            p.data = saved[n]


def train_step(rank: int, world_size: int, overrides: list[str]) -> dict:
    """One step on `batch()`; the metrics, and the gradient and updated weights in HF names (rank 0)."""
    cfg = load_config(None, ["train.lr=1e-3", "uaq.enabled=false", "precision=bf16", "train.loss=ppo",
                             "train.grad_clip=0", "train.micro_batch_size=2", *overrides])
    trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)
    try:
        metrics = trainer.step(batch(moe=trainer.moe))
        grads = _hf(trainer, {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        weights = _hf(trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return {"metrics": metrics, "grads": grads, "weights": weights} if rank == 0 else {"metrics": metrics}
    finally:
        trainer.close()


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def step_memory(rank: int, tokens: int, rows: int) -> dict:
    """The rise of this process's peak resident memory over a first step of `rows` sequences of `tokens`
    tokens each (one micro-batch), and the plan's bytes for the same config at fp32 (`sizing.trainer_bytes`)."""
    import json

    from qurl_mcore.models import resolve_model_path
    from qurl_mcore.models.registry import shape
    from qurl_mcore.sizing import trainer_bytes

    cfg = load_config(None, ["model.path=tiny-llama", "uaq.enabled=false", "precision=bf16", "train.mini_batches=1",
                             f"rollout.context_length={tokens}", f"rollout.max_new_tokens={tokens // 2}",
                             f"train.micro_batch_size={rows}", "data.prompts_per_step=1",
                             f"rollout.samples_per_prompt={rows}"])
    trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank)
    try:
        g = torch.Generator().manual_seed(0)
        half = tokens // 2
        samples = [Sample(torch.randint(3, 1000, (half,), generator=g).tolist(),
                          torch.randint(3, 1000, (half,), generator=g).tolist(), [-1.0] * half) for _ in range(rows)]
        step = collate(samples, torch.linspace(-1.0, 1.0, rows), pad_id=0)
        # the peak from here: Linux resets VmHWM to the current resident size on "5" (proc(5), clear_refs); the
        # process's lifetime peak (ru_maxrss) may already hold the build's, which the step then never passes
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
        trainer.step(step)
        rise = _status_bytes("VmHWM") - before
    finally:
        trainer.close()
    hf = json.loads((resolve_model_path(cfg.model.path) / "config.json").read_text())
    return {"rise": rise, "plan": trainer_bytes(shape(hf), cfg, cuda=False)}
