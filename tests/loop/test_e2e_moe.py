"""`qurl train` end to end on the tiny MoE architectures, two steps each: the quantized experts on both sides,
the engine's routing replayed in the trainer. (test_e2e.py: the dense loop, its resume and its two-node run.)"""
from __future__ import annotations

import pytest

from tests.loop.runs import assert_code_pushes, metrics, train


@pytest.mark.slow
def test_moe_loop_with_fp4_rc_on_both_sides_and_routing_replay(tmp_path):
    """MoEResQ's symmetric setting: FP4 RC experts in the trainer (Megatron) and the engine (SGLang), with the
    engine's routing replayed in the trainer (R3); the routing agreement measured before replay every step. The
    weights go to the engine as the trainer's FP4 codes and scales (rollout.push=codes), checked every step."""
    overrides = ("model.path=tiny-qwen3_moe", "steps=2", "precision=fp4_rc", "scope=experts", "uaq.enabled=false",
                 "train.routing_replay=r3", "rollout.push=codes")
    train(tmp_path, *overrides)
    assert_code_pushes(tmp_path, *overrides)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    for r in records:  # the tiny MoE has 2 MoE layers; symmetric RC keeps most routes (docs/align.md)
        layers = [r[f"mismatch/topk_match/layer{n}"] for n in (1, 2)]
        assert 0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1
        assert r["mismatch/topk_match"] == pytest.approx(sum(layers) / 2)


@pytest.mark.slow
def test_mixtral_loop(tmp_path):
    """Two steps on tiny-mixtral with an INT8 engine, UAQ and R3: a quantized Mixtral engine is SGLang's FusedMoE
    `MixtralForCausalLM` (qurl_mcore/sglang/architecture.py), which reports its routing, so the trainer replays it;
    the trainer's own routing is compared with the engine's before the replay. (Its unquantized engine, and the
    same routes on both sides there: tests/align/test_align_architectures.py.) The weights go as INT8 codes and
    scales (rollout.push=codes): Mixtral's experts (w1, w3, w2) and attention, checked every step."""
    overrides = ("model.path=tiny-mixtral", "steps=2", "precision=int8", "uaq.enabled=true",
                 "train.routing_replay=r3", "rollout.push=codes")
    train(tmp_path, *overrides)
    assert_code_pushes(tmp_path, *overrides)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    assert all(0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1 for r in records)


@pytest.mark.slow
def test_glm4_moe_loop(tmp_path):
    """Two steps on tiny-glm4_moe (a dense first layer, then a sigmoid router with an expert bias and a shared
    expert): FP4 RC experts on both sides with the engine's routing replayed (R3), pushed as codes (the shared
    expert and the dense layer, outside scope experts, in BF16)."""
    overrides = ("model.path=tiny-glm4_moe", "steps=2", "precision=fp4_rc", "scope=experts", "uaq.enabled=false",
                 "train.routing_replay=r3", "rollout.push=codes")
    train(tmp_path, *overrides)
    assert_code_pushes(tmp_path, *overrides)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    assert all(0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1 for r in records)


@pytest.mark.slow
def test_deepseek_v3_loop(tmp_path):
    """Two steps on tiny-deepseek_v3 (MLA, a dense first layer, shared expert, group-limited sigmoid routing):
    the 8-bit rollout of the shipped DeepSeek-V3 config (INT8 W8A8 engine, UAQ's MLA pairs, code pushes: q_b_proj
    and o_proj as codes, kv_b_proj in full precision beside them), the engine's routing replayed in the trainer
    (R3). Its engine runs MLA's absorbed path on the torch-native backend (qurl_mcore/sglang/cpu.py), with the
    decode weights it rebuilds from the pushed kv_b_proj."""
    overrides = ("model.path=tiny-deepseek_v3", "steps=2", "precision=int8", "uaq.enabled=true",
                 "train.routing_replay=r3", "rollout.push=codes")
    train(tmp_path, *overrides)
    assert_code_pushes(tmp_path, *overrides)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    assert all(0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1 for r in records)
