"""An engine's weight push on a fake GPU through SGLang's own loader code (`device_loading_context` around each
layer's restore and re-quantization), with the qurl plugin loaded as SGLang loads it."""
from __future__ import annotations

import pytest

from qurl_mcore.fakecuda import run_traced

from . import workers


def test_masters_stay_where_they_wait_through_a_push():
    """R3: SGLang stages each layer on the GPU around its restore and sends the re-attached masters there; the
    plugin keeps them out of it, so the push's begin adds no CUDA bytes (without: every host master's) and the
    push ends where it started. master="device": the masters wait on the GPU, and the push moves nothing."""
    pushes = run_traced(workers.engine_pushes, ["host", "device"])
    out = pushes["host"]
    assert out["loaded"] == out["during"] == out["after"] == ["cpu"]
    assert out["restore_bytes"] == out["after_bytes"] == 0 < out["master_bytes"]
    out = pushes["device"]
    assert out["loaded"] == out["during"] == out["after"] == ["cuda:0"]
    assert out["restore_bytes"] == out["after_bytes"] == 0


@pytest.mark.slow  # SGLang's DeepSeek-V3 built, loaded and pushed in a traced process: about a minute
def test_mla_decodes_with_the_full_precision_kv_b_proj_on_sglangs_cuda_branch():
    """Defect 7: on an H100 (SM90: SGLang's CUDA branch) SGLang decodes DeepSeek's MLA with W_uk, W_uv (`w_kc`,
    `w_vc`) rebuilt from kv_b_proj after the load and after every push. A `qurl_int8` engine of scope "all"
    quantizes q_b_proj and o_proj and leaves kv_b_proj full precision, so the decode weights are the pushed
    bf16 kv_b_proj's rows, head by head [k_nope; v], as the trainer pushes them (its linear_kv_up_proj is never
    quantized either: tests/megatron/test_spec.py); the engine reports exactly the table's quantized linears, which
    the symmetry check compares, kv_b_proj not among them."""
    from qurl_mcore.models.tiny import tiny_checkpoint
    from qurl_mcore.precision import quantized_linears

    out = run_traced(workers.mla_decode_weights, "H100-80GB")
    assert out["is_cuda"] and out["sm"] == 90 and out["class"] == "DeepseekV3ForCausalLM"
    for when in ("loaded", "pushed"):
        assert set(out[when]) == {0, 1}  # the dense layer and the MoE one
        for layer in out[when].values():
            heads, nope, v, rank = layer["dims"]
            assert layer["methods"] == {"q_b_proj": "QurlLinearMethod", "kv_b_proj": "UnquantizedLinearMethod",
                                        "o_proj": "QurlLinearMethod"}
            assert layer["kv_b"] == ("torch.bfloat16", (heads * (nope + v), rank))
            assert layer["w_kc"] == ("torch.bfloat16", (heads, nope, rank), "cuda:0")
            assert layer["w_vc"] == ("torch.bfloat16", (heads, rank, v), "cuda:0")
    path = tiny_checkpoint("deepseek_v3")
    reported = set(out["reported"])
    assert reported == quantized_linears(path, "int8", "all", "rollout")  # what the symmetry check wants
    assert {f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_b_proj", "o_proj")} <= reported
    assert not any("kv_b_proj" in n for n in reported)


def test_an_engine_layers_bytes_are_the_cuda_storages_its_modules_hold():
    """What `qurl plan --trace` counts per decoder layer of SGLang's model: every CUDA storage reachable from
    the layer's modules once (parameters, buffers, the plugin's codes in dataclasses, views of them cost
    nothing), not host tensors; here all the façade has alive."""
    counted, alive = run_traced(workers.module_storages)
    assert counted == alive == 128 + 64 + 32 + 16


@pytest.mark.slow  # SGLang's DeepSeek-V3 built at TP 2, loaded and pushed in a traced process: about a minute
def test_the_engine_trace_counts_the_storages_of_sglangs_model_not_the_planners_list():
    """`trace_engine` builds SGLang's own model class at the engine's TP (tiny DeepSeek-V3, an int8 engine at
    TP 2: rank 0 of SGLang's parallel state over a fake group of 2), loads and pushes it through SGLang's loader
    and measures the storages that exist. SGLang's MLA keeps bf16 decode weights rebuilt from kv_b_proj
    (`w_kc` [heads/TP, d_nope, r_kv], `w_vc` [heads/TP, r_kv, d_v] per layer) that no checkpoint tensor and so
    no line of the planner's list holds: the measured weights exceed the planned by at least those. The load's
    peak is the model in bf16 but its routed experts, which are quantized as they load (the plan's `load`),
    and no checkpoint tensor besides: SGLang reads those on the host (fed on the GPU, the tiny model's embedding
    and LM head, most of its bytes, would double it)."""
    from qurl_mcore.config import load_config
    from qurl_mcore.plantrace import TOLERANCE, trace_engine
    from qurl_mcore.sizing import model_config

    cfg = load_config(None, ["model.path=tiny-deepseek_v3", "precision=int8", "rollout.tp_size=2"])
    hf, _ = model_config(cfg.model.path)
    out = trace_engine(cfg, hf)
    assert out["model_class"] == "DeepseekV3ForCausalLM" and out["tp_size"] == 2
    assert out["traced_layers"] == out["layers"] == {"dense": 1, "moe": 1}
    heads = hf["num_attention_heads"] // 2
    decode = 2 * heads * hf["kv_lora_rank"] * (hf["qk_nope_head_dim"] + hf["v_head_dim"])  # bf16, per layer
    assert out["measured_weight_bytes"] - out["planned_weight_bytes"] >= 2 * decode
    assert all(out["layer_bytes"][k] < out["loaded_layer_bytes"][k] for k in ("dense", "moe"))
    assert out["planned_peak_bytes"] <= out["phases"]["load"] <= (1 + TOLERANCE) * out["planned_peak_bytes"]


@pytest.mark.slow  # five loads of SGLang's Qwen3-MoE in a traced process: about a minute and a half
def test_a_moe_load_never_holds_the_experts_in_bf16():
    """The plugin quantizes each expert's piece as SGLang's loader writes it (sglang/moe.py): a MoE layer's load
    on a GPU peaks at its other weights in bf16, the experts' codes and a few fp32 copies of one expert matrix
    (quantize's temporaries), well below its experts in bf16 (6 MiB of 64 experts here; SGLang's load builds the
    model in bf16 and quantizes after loading it: every one of them), for a bf16 push (masters on the host),
    a code push (no masters) and NVFP4, whose gate waits for its up. With master="device" the masters are the
    experts in bf16 on the GPU, by the user's choice."""
    cases = [("qurl_int8", {}), ("qurl_int8", {"push": "codes"}), ("qurl_fp4", {"fmt": "nvfp4", "push": "codes"}),
             ("qurl_fp4_rc", {"fmt": "mxfp4"}), ("qurl_int8", {"master": "device"})]
    out = run_traced(workers.moe_loads, cases)
    for case, load in out.items():
        one_matrix = 16 * load["expert_w13_bf16"]
        assert one_matrix < load["experts_bf16"] / 4
        on_gpu = load["others_bf16"] + load["expert_codes"] + ("device" in case) * load["experts_bf16"]
        assert on_gpu <= load["peak"] <= on_gpu + one_matrix, (case, load)
