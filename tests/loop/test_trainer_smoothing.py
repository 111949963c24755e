"""rollout.smoothing on a real `PolicyTrainer` (tiny Llama, world size 1, in this process): the push carries the
fold of the calibrated scales on top of UAQ, the calibration is that of `qurl_mcore.smoothing.calibrate` on the
run's first prompts, and a resumed trainer pushes bitwise the same weights from the restored scales (and, in a code
push, the same codes and scales as the uninterrupted trainer)."""
from __future__ import annotations

import torch

from qurl_mcore.config import load_config
from qurl_mcore.loop.sampler import engine_config
from qurl_mcore.loop.trainer import CALIBRATION_PROMPTS, PolicyTrainer, calibration_prompts
from qurl_mcore.megatron.convert import read_hf_state
from qurl_mcore.quant.wire import SCALE
from qurl_mcore.smoothing import calibrate, fold_table, smooth_tensor
from qurl_mcore.uaq import uaq_scale_hf

from .test_dist_checkpoint import _save
from .test_trainer import _batch, _RecordingEngine


class _KeepingEngine(_RecordingEngine):
    """The engine side of a tensor push, in process: keeps copies of what it receives."""

    def __init__(self, config):
        super().__init__(config)
        self.kept: dict[str, torch.Tensor] = {}

    def _control(self, call, **kwargs):
        if call == "update_weights_from_tensor":
            self.kept.update({n: t.clone() for n, t in kwargs["named_tensors"]})
        return super()._control(call, **kwargs)


def _trainer(*overrides: str) -> PolicyTrainer:
    # rollout.verify_push off: the in-process engine keeps what it is sent and serves no digests of installed codes
    cfg = load_config(None, ["model.path=tiny-llama", "precision=int8", "uaq.scale=1.5", "rollout.smoothing=0.5",
                             "data.num_prompts=24", "rollout.verify_push=false", *overrides])
    return PolicyTrainer(cfg, cfg.recipe())


def _push(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    engine = _KeepingEngine(engine_config(trainer.cfg, trainer.recipe.engine, str(trainer.hf_dir), "cpu"))
    trainer.engines, trainer.engine_ids = [engine], [0]
    trainer.push_weights("v1")
    return engine.kept


def test_push_folds_the_calibrated_scales_over_uaq_and_a_resume_pushes_the_same(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = _trainer()
    try:
        pushed = _push(trainer)
        scales = trainer.smoothing_scales
        state = trainer.state()
        published = _save(trainer, tmp_path / "ckpt", 1)  # the default format, torch_dist
    finally:
        trainer.close()
    hf_dir = trainer.hf_dir
    # the calibration: rank 0's HF model on the run's first prompts (24 here, fewer than CALIBRATION_PROMPTS)
    prompts = calibration_prompts(trainer.cfg, AutoTokenizer.from_pretrained(hf_dir))
    assert len(prompts) == min(24, CALIBRATION_PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    again = calibrate(model, prompts, trainer.hf, trainer.recipe.engine.groups, 0.5)
    assert scales.keys() == again.keys() and all(torch.equal(scales[k], again[k]) for k in scales)
    # what the engine got: the fold of the UAQ-scaled weights, in bf16
    table = fold_table(trainer.hf, trainer.recipe.engine.groups)
    hf = read_hf_state(hf_dir)
    assert set(pushed) == set(hf) and set(table) <= set(hf)
    for name, tensor in hf.items():
        want = smooth_tensor(name, uaq_scale_hf(name, tensor.float(), 1.5), scales, table).bfloat16()
        assert pushed[name].dtype == torch.bfloat16
        torch.testing.assert_close(pushed[name].float(), want.float(), rtol=1e-2, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q].float(), uaq_scale_hf(q, hf[q].float(), 1.5), rtol=0.1)  # it moved
    # the checkpoint holds the scales; a resumed trainer pushes bitwise the same weights with them, even where
    # its own prompts would calibrate other scales
    torch.save(state, tmp_path / "s.pt")
    resumed = _trainer("seed=5", "checkpoint.format=torch")
    try:
        resumed.load_state(torch.load(tmp_path / "s.pt", weights_only=False))
        assert all(torch.equal(resumed.smoothing_scales[k], scales[k]) for k in scales)
        pushed_again = _push(resumed)
    finally:
        resumed.close()
    assert all(torch.equal(pushed_again[n], pushed[n]) for n in pushed)
    resumed = _trainer("seed=5")
    try:
        resumed.load_checkpoint(str(published))
        assert all(torch.equal(resumed.smoothing_scales[k], scales[k]) for k in scales)
    finally:
        resumed.close()


def test_a_resumed_trainer_pushes_the_codes_of_the_uninterrupted_one(tmp_path):
    """rollout.push=codes: checkpointed after step 1, the trainer resumed from it pushes after step 2 the codes and
    scales of the trainer that went on, bit for bit (the restored weights, optimizer state and smoothing scales
    all reach the codes: a resumed run's engines serve what the uninterrupted run's would)."""
    def second_push(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
        trainer.step(_batch(trainer, seed=1))
        return _push(trainer)

    trainer = _trainer("rollout.push=codes")
    try:
        _push(trainer)  # as the loop does before step 1: the smoothing scales are calibrated, then checkpointed
        trainer.step(_batch(trainer, seed=0))
        published = _save(trainer, tmp_path / "ckpt", 1)
        want = second_push(trainer)
    finally:
        trainer.close()
    resumed = _trainer("rollout.push=codes", "seed=5")
    try:
        resumed.load_checkpoint(str(published))
        got = second_push(resumed)
    finally:
        resumed.close()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert want[q].dtype == torch.int8 and q + SCALE in want  # the push carried codes and scales
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_calibration_runs_on_the_host_whatever_the_trainers_device():
    """The HF model in fp32 would not fit beside the trainer on rank 0's GPU: the calibration never moves it to
    the trainer's device. A trainer whose device holds no data (`meta`) still calibrates, and gets the scales of
    the model on the host."""
    import types

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qurl_mcore.megatron.gpt import load_hf_config
    from qurl_mcore.models import resolve_model_path

    cfg = load_config(None, ["model.path=tiny-llama", "precision=int8", "rollout.smoothing=0.5", "data.num_prompts=4"])
    path = resolve_model_path(cfg.model.path)
    rank0 = types.SimpleNamespace(hf_dir=path, hf=load_hf_config(path), cfg=cfg, recipe=cfg.recipe(),
                                  device=torch.device("meta"))
    scales = PolicyTrainer._calibrate(rank0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = calibrate(model, calibration_prompts(cfg, AutoTokenizer.from_pretrained(path)), rank0.hf,
                     rank0.recipe.engine.groups, 0.5)
    assert scales.keys() == want.keys() and all(torch.equal(scales[k], want[k]) for k in want)
