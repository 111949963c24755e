"""Activation smoothing (qurl_mcore/smoothing.py): the fold is exact in full precision on every dense layout
(GQA, q/k/v biases, q/k norms, a shared expert beside a router), it composes with UAQ, and the calibration is
deterministic."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.models.registry import hf_uaq_role
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import SCOPES
from qurl_mcore.smoothing import (GROUPED, calibrate, fold_table, refusal, scales_from_maxima, smooth_tensor,
                                  smoothing_points)
from qurl_mcore.uaq import uaq_scale_hf

ALL = SCOPES["all"]


def _model(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32).eval()


def _prompts(n: int = 4, length: int = 12, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 5000, (length,), generator=g) for _ in range(n)]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.reshape(1, -1)).logits.double()


def _fold_into(model, transform) -> dict[str, torch.Tensor]:
    """Load transform(name, tensor) of every parameter into `model`; returns the original state."""
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict({k: transform(k, v) for k, v in original.items()})
    return original


def test_scales_are_the_smoothquant_formula():
    # s = x^α / w^(1−α): α = 0.5 balances the two maxima; α = 1 moves everything to the weights
    x, w = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 9.0])
    assert torch.allclose(scales_from_maxima(x, w, 0.5), torch.tensor([2.0, 0.5, (1e-5) ** 0.5 / 3.0]))
    assert torch.equal(scales_from_maxima(x, w, 1.0), torch.tensor([4.0, 1.0, 1e-5]))
    with pytest.raises(ValueError, match="α must be in \\(0, 1\\]"):
        scales_from_maxima(x, w, 0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe",
                                  "deepseek_v3"])
def test_the_smoothed_model_computes_the_same_in_full_precision(arch):
    model = _model(arch)
    ids = _prompts(1, 20, seed=7)[0]
    before = _logits(model, ids)
    scales = calibrate(model, _prompts(), model.config, ALL, alpha=0.5)
    table = fold_table(model.config, ALL)
    # a transform that changed nothing would pass the comparison: the scales are far from 1, and every
    # absorbing tensor changes
    assert max(float((s.log().abs()).max()) for s in scales.values()) > 1.0
    original = _fold_into(model, lambda k, v: smooth_tensor(k, v, scales, table))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, original[k])}
    assert changed == {k for k in set(table) & set(original) if original[k].any()}  # (a random model's v bias is 0)
    after = _logits(model, ids)
    assert torch.allclose(after, before, rtol=0, atol=2e-4 * before.abs().max())
    # and the engine would see something else than before: every consumer's weight really moved
    consumers = [n for points in smoothing_points(model.config, ALL).values() for n in points]
    assert consumers and not any(torch.allclose(model.state_dict()[n], original[n]) for n in consumers)


def test_grouped_query_attention_shares_an_o_scale_per_kv_row():
    model = _model("llama")  # 4 q heads over 2 kv heads of 32
    scales = calibrate(model, _prompts(), model.config, ALL, alpha=0.5)
    s = scales["layers.0.attention." + GROUPED]
    assert s.shape == (2, 32)
    table = fold_table(model.config, ALL)
    o = next(n for n in table if hf_uaq_role(n) == "o" and ".0." in n)
    w = torch.ones(128, 128)
    folded = smooth_tensor(o, w, {k: v for k, v in scales.items()}, table)
    # q heads 0, 1 read kv head 0; heads 2, 3 kv head 1: columns h·32 + d take s[h // 2, d]
    expect = s[[0, 0, 1, 1]].reshape(-1)
    assert torch.equal(folded[0], expect) and torch.equal(folded[77], expect)


def test_routers_and_routed_experts_are_left_alone():
    model = _model("qwen3_moe")
    table = fold_table(model.config, ALL)
    roles = {hf_uaq_role(n) for n in table}
    assert roles == {"attn_norm", "q", "k", "v", "o"}  # the MLP input is the router's: not smoothed
    assert not any(k.endswith("linear_fc1") for k in smoothing_points(model.config, ALL))
    # scope experts quantizes no attention: nothing is smoothed
    assert fold_table(model.config, SCOPES["experts"]) == {}


def test_smoothing_composes_with_uaq():
    # the trainer's parameters are UAQ-scaled (u), the fold acts on them: the engine's weight is (W/u)·diag(s),
    # its norm γ·u/s, and the function is unchanged; the order of the two does not matter
    model = _model("llama")
    ids = _prompts(1, 16, seed=3)[0]
    before = _logits(model, ids)
    scales = calibrate(model, _prompts(), model.config, ALL, alpha=0.8)
    table = fold_table(model.config, ALL)
    u = 1.5
    one = {k: smooth_tensor(k, uaq_scale_hf(k, v, u), scales, table) for k, v in model.state_dict().items()}
    other = {k: uaq_scale_hf(k, smooth_tensor(k, v, scales, table), u) for k, v in model.state_dict().items()}
    for k in one:
        assert torch.allclose(one[k], other[k], rtol=1e-6, atol=0), k
    q = "model.layers.1.self_attn.q_proj.weight"
    w = model.state_dict()[q]
    assert torch.allclose(one[q], w / u * scales["layers.1.attention.linear_qkv"], rtol=1e-6)
    model.load_state_dict(one)
    assert torch.allclose(_logits(model, ids), before, rtol=0, atol=2e-4 * before.abs().max())


def test_calibration_is_deterministic_and_independent_of_prompt_order():
    model = _model("qwen2")
    prompts = _prompts(5)
    a = calibrate(model, prompts, model.config, ALL, alpha=0.5)
    b = calibrate(model, prompts[::-1], model.config, ALL, alpha=0.5)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = calibrate(model, _prompts(5, seed=2), model.config, ALL, alpha=0.5)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the prompts matter


def test_formats_it_serves_and_those_it_refuses():
    assert refusal("int8") is None and refusal("fp8_e4m3") is None
    assert "full precision" in refusal(None)
    assert "blocks" in refusal("nvfp4") and "blocks" in refusal("mxfp4")
