"""Trainer checkpoints in Megatron's distributed format (torch_dist): a resumed run continues the uninterrupted
one (bitwise on the same layout; to fp32 rounding on another TP/PP/EP layout), with its random generators, the
checksums and the fallback of every checkpoint, also when written in the background while training goes on
(checkpoint.async_save), and a checkpoint of the per-rank format still loads."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qurl_mcore import checkpoint as ckpt
from qurl_mcore.config import load_config, to_dict
from qurl_mcore.loop.trainer import PolicyTrainer
from qurl_mcore.megatron.parallel import spawn

from . import workers

BASE = ["train.lr=1e-3", "uaq.enabled=false", "precision=bf16", "train.loss=ppo", "train.grad_clip=0",
        "train.micro_batch_size=2"]


def _trainer(model: str, overrides: list[str], rank: int = 0, world_size: int = 1) -> PolicyTrainer:
    cfg = load_config(None, [*BASE, f"model.path={model}", *overrides])
    return PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)


def _save(trainer: PolicyTrainer, root, step: int):
    """What the driver does, from the trainer's ranks: every rank saves, rank 0 publishes."""
    return _publish(trainer, root, step, trainer.save_checkpoint(str(root), step))


def _publish(trainer: PolicyTrainer, root, step: int, files: list[dict]):
    """Rank 0 publishes step `step`'s checkpoint once every rank's files are written (with the records of a save
    in flight, checkpoint.async_save)."""
    files = files + trainer.finish_checkpoint()
    if dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, files)
        files = [record for rank in every for record in rank]
    if dist.get_rank() == 0:
        meta = {"format": trainer.cfg.checkpoint.format, "world_size": dist.get_world_size(),
                "config": to_dict(trainer.cfg)}
        return ckpt.finalize(root, step, files, meta)
    return None


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """The whole model in HF names (gathered over every rank's slices)."""
    return workers._hf(trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})


def _second_step(trainer: PolicyTrainer) -> dict:
    metrics = trainer.step(workers.batch(seed=1, moe=trainer.moe))
    return {"loss": metrics["loss/total"], "weights": _weights(trainer)}


@pytest.mark.slow  # three trainers, four saves (about a minute)
def test_same_layout_continues_bitwise_with_its_random_generators_and_reads_the_per_rank_format(tmp_path):
    """The torch_dist checkpoint is written in the background (checkpoint.async_save) while the next step trains,
    and published after it: it holds the state at save time."""
    trainer = _trainer("tiny-llama", ["checkpoint.async_save=true"])
    try:
        trainer.step(workers.batch(seed=0))
        torch.manual_seed(1234)  # the generators at save time, which a fresh trainer's are not
        trainer.cfg.checkpoint.format = "torch"
        torch_path = _save(trainer, tmp_path / "torch", 1)
        trainer.cfg.checkpoint.format = "torch_dist"
        in_flight = trainer.save_checkpoint(str(tmp_path / "dist"), 1)
        assert in_flight == []  # the slices' records come when they are written
        drawn = torch.rand(4)
        expected = _second_step(trainer)
        dist_path = _publish(trainer, tmp_path / "dist", 1, in_flight)
        trainer.cfg.checkpoint.async_save = False
        damaged = _save(trainer, tmp_path / "dist", 2)
    finally:
        trainer.close()
    names = [r["file"] for r in ckpt.read_meta(dist_path)["files"]]
    assert {"trainer/metadata.json", "trainer/common.pt", "trainer/.metadata", "trainer/__0_0.distcp"} <= set(names)
    assert ckpt.read_meta(dist_path)["format"] == "torch_dist" and ckpt.verify(dist_path) is None
    by_format = [ckpt.model_tensors(p) for p in (dist_path, torch_path)]  # read without a process group
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the same name in both
        assert torch.equal(by_format[0][name], by_format[1][name]), name
    # a flipped byte in a slice file: resuming falls back to the checkpoint before
    target = damaged / "trainer" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    assert ckpt.latest_valid(tmp_path / "dist") == (dist_path, [(damaged, "trainer/__0_0.distcp does not match "
                                                                          "its checksum")])
    for path in (dist_path, torch_path):  # this run writes torch_dist; a per-rank checkpoint still loads
        resumed = _trainer("tiny-llama", [])
        try:
            resumed.load_checkpoint(str(path))
            if path == dist_path:
                assert torch.equal(torch.rand(4), drawn)
            got = _second_step(resumed)
        finally:
            resumed.close()
        assert got["loss"] == expected["loss"]
        for name, w in expected["weights"].items():
            assert torch.equal(got["weights"][name], w), name


def _megatron_lm_checkpoint(root, iteration: int = 3) -> dict[str, torch.Tensor]:
    """What Megatron-LM (and slime) save: Megatron's own GPTModel (its local spec, its own random init) shaped
    like tiny-llama, written by `dist_checkpointing.save` as iter_0000003 of a --save directory. Returns its
    weights."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from qurl_mcore.megatron import destroy_parallel, init_parallel
    from qurl_mcore.megatron.gpt import gpt_config, load_hf_config, rope_theta
    from qurl_mcore.models import resolve_model_path

    hf = load_hf_config(resolve_model_path("tiny-llama"))
    init_parallel(seed=7)
    try:
        model = GPTModel(config=gpt_config(hf, use_cpu_initialization=True),
                         transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=hf.vocab_size,
                         max_sequence_length=hf.max_position_embeddings, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", rotary_base=rope_theta(hf))
        directory = root / f"iter_{iteration:07d}"
        directory.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration,
                                 "checkpoint_version": 3.0}, str(directory))
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_parallel()


def test_model_load_starts_from_a_checkpoint_megatron_saved(tmp_path):
    saved = _megatron_lm_checkpoint(tmp_path)
    trainer = _trainer("tiny-llama", [f"model.load={tmp_path}"])
    try:
        got = {n: p.detach() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    assert got.keys() == saved.keys()
    for name, w in saved.items():
        assert torch.equal(got[name], w), name


def test_model_load_names_what_it_expects():
    from qurl_mcore.megatron.dist_checkpoint import checkpoint_dir

    with pytest.raises(FileNotFoundError, match="is not a torch_dist checkpoint .*latest_checkpointed_iteration"):
        checkpoint_dir("/nonexistent")


# -- another layout: saved at TP=2 after one step, the second step resumed at TP=1, PP=2 or EP=2 -----------------
def _save_then_step(rank: int, world_size: int, model: str, overrides: list[str], root: str) -> dict:
    """The first step, its checkpoint written in the background while the second step trains, then published."""
    trainer = _trainer(model, [*overrides, "checkpoint.async_save=true"], rank, world_size)
    try:
        trainer.step(workers.batch(seed=0, moe=trainer.moe))
        in_flight = trainer.save_checkpoint(root, 1)
        second = _second_step(trainer)
        return {"path": str(_publish(trainer, root, 1, in_flight)), **second}
    finally:
        trainer.close()


def _resume_then_step(rank: int, world_size: int, model: str, overrides: list[str], path: str) -> dict:
    trainer = _trainer(model, overrides, rank, world_size)
    try:
        trainer.load_checkpoint(path)
        return _second_step(trainer)
    finally:
        trainer.close()


RESHARD = {
    "tp2-to-tp1": ("tiny-llama", 1, []),
    "tp2-to-pp2": ("tiny-llama", 2, ["train.pp_size=2"]),
    "tp2-to-ep2": ("tiny-qwen3_moe", 2, ["train.dp_size=2", "train.ep_size=2"]),
}


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    """Per model: the uninterrupted TP=2 run's second step, and its checkpoint after the first."""
    return {model: spawn(_save_then_step, 2, 2, model, ["train.tp_size=2"], str(tmp_path_factory.mktemp(model)))[0]
            for model in sorted({m for m, _, _ in RESHARD.values()})}


@pytest.mark.slow  # two to three Megatron launches of two processes
@pytest.mark.parametrize("case", list(RESHARD))
def test_resume_on_another_layout_equals_the_uninterrupted_run(saved_at_tp2, case):
    model, world_size, overrides = RESHARD[case]
    uninterrupted = saved_at_tp2[model]
    got = spawn(_resume_then_step, world_size, world_size, model, overrides, uninterrupted["path"])[0]
    assert got["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5, abs=1e-7)
    assert got["weights"].keys() == uninterrupted["weights"].keys()
    for name, w in uninterrupted["weights"].items():
        moved = (got["weights"][name] - w).abs()
        # fp32 rounding, except where Adam's step is ±lr on a gradient of ~0 whose rounding (the reductions differ
        # by layout) flips it; a lost moment, step count or weight moves most elements
        assert (moved > 1e-6).float().mean() < 0.01 and moved.max() <= 2e-3, (name, moved.max())
