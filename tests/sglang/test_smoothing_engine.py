"""rollout.smoothing against a real SGLang INT8 engine on CPU: SmolLM2's activation outliers make per-token INT8
coarse; the same engine, pushed the smoothed weights (the loop's push: the fold of the calibrated scales, in
bf16), is closer to the full-precision model's log-probs on the same sequences. A tiny random model has no such
outliers, so this runs on SmolLM2 (slow lane)."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.config import load_config
from qurl_mcore.loop.trainer import calibration_prompts
from qurl_mcore.precision import SCOPES
from qurl_mcore.smoothing import calibrate, fold_table, smooth_tensor

from .conftest import checkpoint_tensors, local_engine, model_path, prompt_ids, score
from .reference import reference_model, token_logprobs

pytestmark = pytest.mark.slow  # a real engine on SmolLM2


def test_a_smoothed_int8_engine_is_closer_to_the_full_precision_model():
    from transformers import AutoTokenizer

    path = model_path("smollm2")
    cfg = load_config(None, ["precision=int8", "rollout.smoothing=0.5"])
    prompts = calibration_prompts(cfg, AutoTokenizer.from_pretrained(path))
    sequences = [prompt_ids(path)] + [p.tolist() for p in prompts[:3]]
    full = reference_model(path, None, dtype=torch.float32)  # the trainer's function: no quantization
    want = [token_logprobs(full, s) for s in sequences]
    scales = calibrate(full, prompts, full.config, SCOPES["all"], cfg.rollout.smoothing)
    table = fold_table(full.config, SCOPES["all"])

    def gap(engine) -> float:
        """Mean |Δ log p| per token between the engine and the full-precision model."""
        return float(torch.cat([(score(engine, s) - w).abs() for s, w in zip(sequences, want)]).mean())

    with local_engine(path, "qurl_int8") as engine:
        plain = gap(engine)
        original = checkpoint_tensors(path)
        engine.push_weights(((k, smooth_tensor(k, v, scales, table).to(v.dtype)) for k, v in original.items()),
                            version="smoothed")
        smoothed = gap(engine)
    print(f"INT8 engine, mean |Δ log p| per token: {plain:.4f} nat unsmoothed, {smoothed:.4f} smoothed (α 0.5)")
    assert smoothed < 0.8 * plain, (plain, smoothed)
