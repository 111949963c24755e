"""Resume refuses a checkpoint of another run (model, precision, parallel layout), naming each differing field
with both values, before any actor starts; `checkpoint.allow_mismatch` lets the user continue it on purpose."""
import pytest
import torch

from qurl_mcore import checkpoint as ckpt
from qurl_mcore.config import ConfigError, load_config, to_dict
from qurl_mcore.loop.driver import check_resumable, resume_mismatch, run


def _run_config(tmp_path, *overrides):
    return load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'logs'}",
                              "model.path=smollm2", *overrides])


def _checkpoint_of(cfg):
    files = [ckpt.write_file(cfg.checkpoint.dir, 3, "rank0.pt", {"model": {"w": torch.zeros(2)}})]
    return ckpt.finalize(cfg.checkpoint.dir, 3, files, {"world_size": 1, "config": to_dict(cfg)})


def test_each_differing_field_is_named_with_both_values(tmp_path):
    saved = to_dict(_run_config(tmp_path, "precision=int8", "train.tp_size=1", "checkpoint.format=torch"))
    now = _run_config(tmp_path, "precision=fp8", "train.tp_size=2", "train.lr=1e-5", "steps=99")
    assert resume_mismatch(saved, now) == ["precision: 'int8' (checkpoint) vs 'fp8' (this run)",
                                           "train.tp_size: 1 (checkpoint) vs 2 (this run)"]
    # a torch_dist checkpoint loads on another layout: only the model and precision count
    saved["checkpoint"]["format"] = "torch_dist"
    assert resume_mismatch(saved, now) == ["precision: 'int8' (checkpoint) vs 'fp8' (this run)"]
    # what a run may change between its resumes (lr, steps) is not compared; nor a field the checkpoint lacks
    assert resume_mismatch(saved, _run_config(tmp_path, "train.lr=1e-5", "steps=99")) == []
    assert resume_mismatch({"model": {}}, now) == []


def test_a_run_refuses_another_runs_checkpoint_before_starting(tmp_path):
    path = _checkpoint_of(_run_config(tmp_path, "precision=int8"))
    cfg = _run_config(tmp_path, "precision=fp8", "model.path=tiny-llama")
    for _ in range(2):  # the run's directory locks are released: the same refusal again, not "in use"
        with pytest.raises(ConfigError) as err:
            run(cfg)
        assert str(err.value) == (
            f"{path} was written by another run: model.path: 'smollm2' (checkpoint) vs 'tiny-llama' (this run); "
            "precision: 'int8' (checkpoint) vs 'fp8' (this run); give this run its own checkpoint.dir, or set "
            "checkpoint.allow_mismatch=true to continue that checkpoint with this run's settings")


def test_allow_mismatch_continues_another_runs_checkpoint(tmp_path):
    path = _checkpoint_of(_run_config(tmp_path, "precision=int8"))
    with pytest.raises(ConfigError, match="precision: 'int8' \\(checkpoint\\) vs 'fp8' \\(this run\\)"):
        check_resumable(_run_config(tmp_path, "precision=fp8"), path)
    check_resumable(_run_config(tmp_path, "precision=fp8", "checkpoint.allow_mismatch=true"), path)
    check_resumable(_run_config(tmp_path, "precision=int8"), path)  # its own run
    check_resumable(_run_config(tmp_path, "precision=fp8"), None)  # nothing to resume
