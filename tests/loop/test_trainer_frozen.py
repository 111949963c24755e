"""`train.frozen: experts` (MoEResQ's discriminator row): a step of the real trainer on tiny Qwen3-MoE moves the
attention, the routers and the norms and leaves every routed expert's weight bitwise as loaded; a dense model
is refused at `--check`."""
from __future__ import annotations

import torch

from qurl_mcore.config import load_config
from qurl_mcore.loop.trainer import PolicyTrainer
from qurl_mcore.models.registry import megatron_slot
from qurl_mcore.preflight import preflight

from .test_trainer import _batch, _params


def test_frozen_experts_stay_as_loaded_while_the_rest_trains():
    cfg = load_config(None, ["model.path=tiny-qwen3_moe", "train.lr=1e-3", "uaq.enabled=false", "precision=bf16",
                             "train.frozen=experts"])
    trainer = PolicyTrainer(cfg, cfg.recipe())
    try:
        before = _params(trainer)
        metrics = trainer.step(_batch(trainer, behav_from_model=False))
        after = _params(trainer)
        # Megatron's optimizer wraps torch's; its groups hold what it steps
        stepped = sum(len(g["params"]) for g in trainer.stack.optimizer.optimizer.param_groups)
    finally:
        trainer.close()
    assert metrics["train/grad_norm"] > 0 and metrics["train/skipped_nonfinite"] == 0.0
    group = {name: megatron_slot(name).group for name in before}
    experts = [n for n in before if group[n] == "experts"]
    assert len(experts) == 16  # 2 layers x 4 experts x (fc1, fc2)
    assert all(torch.equal(before[n], after[n]) for n in experts)
    for kind in ("attention", "router", "norm"):
        moved = [n for n in before if group[n] == kind and not torch.equal(before[n], after[n])]
        assert moved, f"no {kind} parameter moved"
    assert stepped == sum(1 for n in before if group[n] != "experts")  # and no Adam moments for the experts


def test_frozen_experts_on_a_dense_model_are_refused_by_name():
    cfg = load_config(None, ["model.path=tiny-llama", "train.frozen=experts"])
    problems = preflight(cfg).problems
    assert any(p.startswith("train.frozen: experts") and "dense" in p for p in problems), problems
