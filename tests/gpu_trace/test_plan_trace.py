"""`qurl plan --trace` (qurl_mcore/plantrace.py): a shipped config's trainer rank and engine GPU traced at full size
on fake CUDA devices, their measured peaks beside the plan's; and the plan's update-capture term, which a trace of
the 7B config found missing."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from qurl_mcore.cli import main
from qurl_mcore.config import load_config
from qurl_mcore.models.cards import card
from qurl_mcore.models.registry import shape
from qurl_mcore.plantrace import GPU_PACKAGES, extrapolate, per_layer, stage_layers, traced_models
from qurl_mcore.sizing.memory import trainer_bytes, update_capture_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"


def test_update_capture_holds_the_engine_quantized_shards_once_during_a_step_and_twice_at_its_end():
    """Qwen2.5-Math-7B at TP 2, int8 engines of scope all: per layer q and o 3584², k and v 3584·512 each, the
    SwiGLU 3·3584·18944, 233,046,016 weights; 28 layers /2 = 3,262,644,224 per rank, 2 bytes each. The largest
    shard is gate's or up's, 18944·3584/2 = 33,947,648 elements, 10 bytes each while its codes are compared."""
    cfg = load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml")
    s = shape(card("Qwen2.5-Math-7B"))
    assert update_capture_bytes(s, cfg) == [{"during": 6_525_288_448, "end": 13_050_576_896 + 339_476_480}]
    t = trainer_bytes(s, cfg)
    assert t["peak"] == t["static"] + max(t["activations"]["full"] + 6_525_288_448, 13_390_053_376)
    cfg.logging.update_capture = False
    assert update_capture_bytes(s, cfg) == [{"during": 0, "end": 0}]
    bf16 = load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", ["precision=bf16", "uaq.enabled=false"])
    assert update_capture_bytes(s, bf16) == [{"during": 0, "end": 0}]  # engines in bf16: nothing to capture


@pytest.mark.parametrize("config, card_name, layers, models", [
    ("grpo_deepseek_v3_int8", "DeepSeek-V3", {"dense": 3, "moe": 58},
     [{"dense": 1, "moe": 1}, {"dense": 2, "moe": 1}, {"dense": 1, "moe": 2}]),
    ("grpo_qwen3_30b_a3b_fp4_rc", "Qwen3-30B-A3B", {"dense": 0, "moe": 48},
     [{"dense": 0, "moe": 1}, {"dense": 0, "moe": 2}]),
    ("dapo_qwen2.5_7b_math_int8", "Qwen2.5-Math-7B", {"dense": 28, "moe": 0},
     [{"dense": 1, "moe": 0}, {"dense": 2, "moe": 0}]),
])
def test_a_deep_stage_is_traced_with_layers_of_each_kind_and_extrapolated_per_kind(config, card_name, layers, models):
    """The stage's dense prefix and MoE layers are traced apart (one of each, then one more of each kind), and
    the extrapolation recovers any figure linear in the layers of each kind exactly, and its slope per kind."""
    cfg = load_config(CONFIGS / f"{config}.yaml")
    s = shape(card(card_name))
    assert stage_layers(s, cfg, 0) == layers and traced_models(layers) == models
    linear = lambda m: {"peak": 1000 + 7 * m["dense"] + 11 * m["moe"]}  # noqa: E731
    assert extrapolate([linear(m) for m in models], models, layers) == linear(layers)
    slope = {"dense": 7, "moe": 11}  # a kind the stage lacks is not traced: nothing known, 0
    assert per_layer([linear(m) for m in models], models) == {"peak": {k: slope[k] if n else 0
                                                                        for k, n in layers.items()}}


def test_a_shallow_stage_is_traced_whole_and_the_dense_prefix_lands_on_the_first_stages():
    """GLM-4.5-Air, 46 layers (the first dense) on 2 pipeline stages: 1 dense + 22 MoE, then 23 MoE; a stage of
    at most 8 layers is traced as it is."""
    cfg = load_config(CONFIGS / "grpo_glm45_air_fp4_rc.yaml")
    s = shape(card("GLM-4.5-Air"))
    assert stage_layers(s, cfg, 0) == {"dense": 1, "moe": 22} and stage_layers(s, cfg, 1) == {"dense": 0, "moe": 23}
    assert traced_models({"dense": 3, "moe": 5}) == [{"dense": 3, "moe": 5}]


@pytest.mark.slow
def test_plan_trace_of_the_shipped_0_5b_config_agrees_with_the_plan(capsys):
    """Qwen2.5-0.5B (gsm8k PPO, TP 1 x DP 8, 8 x 1024 tokens a micro-batch): 24 layers, traced at 1 and 2 and
    extrapolated. Its engine, SGLang's Qwen2ForCausalLM, imports SGLang's CuTe DSL dual GEMM for its MLP on CUDA,
    which needs two of SGLang's own dependencies that the CPU environment lacks (cuda-python, nvidia-cutlass-dsl):
    without them the trace says so and measures nothing; with them it is built and agrees with the plan."""
    assert main(["plan", "--config", str(CONFIGS / "gsm8k_ppo_qwen2.5_0.5b_int8.yaml"), "--trace", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    trainer, engine = out["trace"]["trainer"], out["trace"]["engine"]
    assert trainer["planned_peak_bytes"] == out["trainer"]["peak_with_push"]
    assert engine["planned_peak_bytes"] == out["engines"]["load"]
    assert engine["planned_weight_bytes"] == out["engines"]["weights"]["gpu_weights"]
    assert engine["layers"] == {"dense": 24, "moe": 0}
    if all(importlib.util.find_spec(name) for name in GPU_PACKAGES):
        assert engine["model_class"] == "Qwen2ForCausalLM" and engine["agree"]
        assert engine["traced_layers"] == {"dense": 1, "moe": 0}
    else:
        assert engine["not_built"].startswith("SGLang's Qwen2ForCausalLM on CUDA imports cuda")
        assert engine["agree"] is None and "measured_peak_bytes" not in engine
        assert engine["traced_layers"] == {"dense": 0, "moe": 0}
    assert trainer["traced_models"] == [{"dense": 1, "moe": 0}, {"dense": 2, "moe": 0}]
    assert trainer["traced_layers"] == {"dense": 2, "moe": 0}
    # one optimizer step: its gradient norm and finalize_model_grads' token count, then the metrics' reduction and
    # the update-capture metric (docs/plan.md), none per layer
    assert trainer["host_syncs"] == 4 and trainer["host_syncs_per_layer"] == {"dense": 0, "moe": 0}
    phases = trainer["phases"]
    assert phases["build"] < phases["forward_backward"] == trainer["measured_peak_bytes"]
    # a push's export at TP 1 in the trainer's dtype: the states after the step (Adam's included), the buckets
    # views of the parameters but for the attention's re-laid-out q/k/v
    assert trainer["planned"]["push"] == out["trainer"]["static"]
    assert phases["build"] < phases["push"] <= 1.02 * trainer["planned"]["push"]
    assert abs(trainer["measured_peak_bytes"] - trainer["planned_peak_bytes"]) <= 0.15 * trainer["planned_peak_bytes"]
    assert trainer["agree"]


@pytest.mark.slow  # two traced processes, about 30 s
def test_each_traced_optimizer_step_holds_a_whole_micro_batch_whatever_the_mini_batches():
    """A run's mini-batches each hold micro-batches of `train.micro_batch_size` rows; so must the trace's, or a
    config with `train.mini_batches` > 1 is traced on parts of a micro-batch (Qwen3-30B-A3B's 4 mini-batches had
    held one row of its two, 16.9% under the plan). Tiny Llama, 2 x 256 tokens: the forward and backward's
    peak with 4 mini-batches is that of one."""
    from qurl_mcore.models.tiny import tiny_checkpoint
    from qurl_mcore.plantrace import trace_trainer

    hf = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    peaks = {}
    for mini in (1, 4):
        cfg = load_config(None, ["model.path=tiny-llama", "train.micro_batch_size=2", f"train.mini_batches={mini}",
                                 "rollout.context_length=256", "logging.update_capture=false"])
        peaks[mini] = trace_trainer(cfg, hf)["phases"]["forward_backward"]
    assert peaks[4] == pytest.approx(peaks[1], rel=1e-4)  # π_prox of the rows beside it: a few KB


def test_an_engine_loads_every_weight_in_its_dtype_before_it_quantizes():
    """SGLang builds the model in rollout.dtype and quantizes after loading all of it: the plan's `load` for the
    0.5B int8 engine (TP 1, tied embedding) is Qwen2.5-0.5B's published 494,032,768 parameters in bf16, above
    its int8 weights; at TP 2 the norms stay whole (24 layers × 2 + 1 of 896, and q/k/v biases split)."""
    from qurl_mcore.sizing.gpus import get_gpu
    from qurl_mcore.sizing.memory import engine_bytes

    s = shape(card("Qwen2.5-0.5B-Instruct"))
    cfg = load_config(CONFIGS / "gsm8k_ppo_qwen2.5_0.5b_int8.yaml")
    e = engine_bytes(s, cfg, get_gpu("h100-80g"))
    assert e["load"] == 2 * 494_032_768 > e["weights"]["gpu_weights"]
    norms = 2 * 896 * (2 * 24 + 1)
    cfg = load_config(CONFIGS / "gsm8k_ppo_qwen2.5_0.5b_int8.yaml", ["rollout.tp_size=2"])
    assert engine_bytes(s, cfg, get_gpu("h100-80g"))["load"] == (2 * 494_032_768 - norms) // 2 + norms
