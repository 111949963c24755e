import re

import pytest
import torch
from transformers import AutoConfig

from qurl_mcore.megatron.convert import (
    export_hf_weights, load_hf_weights, merge, read_hf_state, shard, split, unshard,
)
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.models.registry import features, slots
from qurl_mcore.models.smollm2 import hf_checkpoint
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.models.upcycle import upcycle_checkpoint

from .helpers import LLAMA3_ROPE, expert_biased_deepseek_v3, hf_logits, hf_model, random_ids, with_config

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"]


def _checkpoint(name):
    return hf_checkpoint() if name == "smollm2" else tiny_checkpoint(name)


def _megatron_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)


@pytest.mark.parametrize("arch", ARCHS + ["smollm2"])
def test_hf_to_megatron_to_hf_round_trip_is_exact(arch, megatron_ws1):
    path = _checkpoint(arch)
    model = build_gpt(path)
    load_hf_weights(model, path)
    original = read_hf_state(path)
    exported = dict(kv for bucket in export_hf_weights(model, path, dtype=torch.bfloat16) for kv in bucket)
    if features(path).isdisjoint({"untied"}):
        original.pop("lm_head.weight", None)
    assert exported.keys() == original.keys()
    # the router's expert bias comes out in fp32 (test_expert_bias_stays_fp32_...), every other tensor in bf16
    assert all(torch.equal(exported[k].to(original[k].dtype), original[k]) for k in original)


@pytest.mark.parametrize("arch", ["smollm2", "qwen3", "qwen3_moe", "qwen2", "llama", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_megatron_logits_equal_hf_transformers(arch, megatron_ws1):
    path = _checkpoint(arch)
    model = build_gpt(path)
    load_hf_weights(model, path)
    ids = random_ids(2, 24)
    ours, ref = _megatron_logits(model, ids), hf_logits(path, ids)
    diff = (ours - ref).abs().max().item()
    print(f"{arch}: max |logits - HF| = {diff:.3g} (max |logit| {ref.abs().max().item():.3g})")
    assert diff <= 2e-5 * ref.abs().max().item(), diff  # fp32 rounding over the model's depth
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_llama3_rope_scaling_equals_hf_transformers(megatron_ws1, tmp_path):
    path = with_config(tmp_path / "changed", "llama", rope_parameters=LLAMA3_ROPE)
    model = build_gpt(path)
    load_hf_weights(model, path)
    hf_inv_freq = hf_model(path).model.rotary_emb.inv_freq
    plain = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    # head dim 32: wavelengths 2π..~3.5e4, so some are divided by 8, some interpolated, some kept
    assert (hf_inv_freq < plain * 0.99).any() and (hf_inv_freq == plain).any()
    assert torch.allclose(model.rotary_pos_emb.inv_freq.cpu(), hf_inv_freq, rtol=1e-6, atol=0)
    ids = random_ids(2, 24)
    ours, ref = _megatron_logits(model, ids), hf_logits(path, ids)
    assert (ours - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("rope,error", [({**LLAMA3_ROPE, "low_freq_factor": 2.0}, "fixes"),
                                        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "'yarn'")])
def test_rope_megatron_cannot_express_is_refused(megatron_ws1, tmp_path, rope, error):
    with pytest.raises(NotImplementedError, match=error):
        build_gpt(with_config(tmp_path / "changed", "llama", rope_parameters=rope))


def test_sliding_window_attention_is_refused(megatron_ws1):
    from qurl_mcore.megatron.gpt import gpt_config

    config = AutoConfig.from_pretrained(tiny_checkpoint("mixtral"))
    config.sliding_window = 4096  # Mistral's; Mixtral-8x7B's is null
    with pytest.raises(NotImplementedError, match="sliding_window 4096"):
        gpt_config(config)


def test_export_buckets_are_bounded_and_uaq_scaled_on_request(megatron_ws1):
    from qurl_mcore.uaq import uaq_scale_hf

    path = tiny_checkpoint("qwen3_moe")
    model = build_gpt(path)
    load_hf_weights(model, path)
    limit = 200_000
    buckets = list(export_hf_weights(model, path, bucket_bytes=limit))
    assert len(buckets) > 2
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= limit or len(bucket) == 1
    plain = dict(kv for b in buckets for kv in b)
    scaled = dict(kv for b in export_hf_weights(model, path, uaq_scale=2.0) for kv in b)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(scaled[q], plain[q] / 2)
    assert torch.equal(scaled["model.layers.1.input_layernorm.weight"], plain["model.layers.1.input_layernorm.weight"] * 2)
    assert torch.equal(scaled["model.layers.0.mlp.experts.3.up_proj.weight"], plain["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert all(torch.equal(scaled[k], uaq_scale_hf(k, plain[k], 2.0)) for k in plain)


def test_slots_follow_the_architecture():
    def megatron_names(arch):
        return {r.megatron.rsplit(".", 2)[-2] for r in slots(tiny_checkpoint(arch))}

    assert features(hf_checkpoint()) == {"tied"}  # SmolLM2: tied embeddings, no biases, no q/k norm
    tied = [r for r in slots(hf_checkpoint()) if r.megatron == "output_layer.weight"]
    # only a later pipeline stage has an output layer of its own, a copy of the embedding, never exported
    assert [(r.hf, r.exported) for r in tied] == [(("model.embed_tokens.weight",), False)]
    assert features(tiny_checkpoint("qwen2")) == {"qkv_bias", "untied"}
    assert {"q_layernorm", "router"} <= megatron_names("qwen3_moe")
    assert "router" not in megatron_names("qwen3")


def test_layouts_invert_and_shard_whole_query_groups():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    cfg.model_type = "qwen3"
    q, k, v = torch.arange(8.).view(8, 1), 100 + torch.arange(4.).view(4, 1), 200 + torch.arange(4.).view(4, 1)
    full = merge("qkv", [q, k, v], cfg)
    # group 0 = [q heads 0-1, k head 0, v head 0], group 1 = [q heads 2-3, k head 1, v head 1]
    assert full.flatten().tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(split("qkv", full, cfg), [q, k, v]))
    assert shard("qkv", full, 1, 2).flatten().tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    gate_up = torch.arange(8.).view(8, 1)  # gate = 0..3, up = 4..7
    shards = [shard("gate_up", gate_up, r, 2) for r in range(2)]
    assert shards[1].flatten().tolist() == [2, 3, 6, 7]
    for layout, t in (("gate_up", gate_up), ("columns", torch.randn(3, 4)), ("rows", torch.randn(4, 3))):
        assert torch.equal(unshard(layout, [shard(layout, t, r, 2) for r in range(2)]), t)


def _copy_with(path, tmp_path, state):
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(path, tmp_path, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_loading_refuses_a_checkpoint_that_does_not_fit(megatron_ws1, tmp_path):
    path = tiny_checkpoint("qwen3")
    model = build_gpt(path)
    state = read_hf_state(path)
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        load_hf_weights(model, _copy_with(path, tmp_path / "a", state))
    state = read_hf_state(path)
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="not loaded"):
        load_hf_weights(model, _copy_with(path, tmp_path / "b", state))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_a_rank_reads_only_its_slices_and_gets_its_shard(arch):
    """Reading a rank's rows/columns/query groups from the file equals cutting its shard from the whole."""
    from qurl_mcore.megatron.convert import _Checkpoint, _read_local

    path = tiny_checkpoint(arch)
    hf = AutoConfig.from_pretrained(path)
    ckpt, state = _Checkpoint(path), read_hf_state(path)
    checked = set()
    for rule in slots(hf):
        names = [t.format(layer=1, expert=3) for t in rule.hf]
        full = merge(rule.layout, [state[n] for n in names], hf)
        for size in (1, 2):
            for rank in range(size):
                assert torch.equal(_read_local(ckpt, rule.layout, names, hf, rank, size),
                                   shard(rule.layout, full, rank, size)), (rule.megatron, rank, size)
        checked.add(rule.layout)
    assert checked >= {"replicated", "rows", "columns", "qkv", "gate_up"}


def test_deepseek_v3_expert_bias_and_group_routing_equal_hf_transformers(megatron_ws1, tmp_path):
    """tiny-deepseek_v3 with a random e_score_correction_bias large enough to change which experts (and expert
    groups) are picked: Megatron's sigmoid router with expert bias and group-limited top-k gives HF's logits."""
    from safetensors.torch import load_file

    path = expert_biased_deepseek_v3(tmp_path / "biased")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    state = load_file(path / "model.safetensors")
    ids = random_ids(2, 24)
    biased, plain = hf_logits(path, ids), hf_logits(tiny_checkpoint("deepseek_v3"), ids)
    assert (biased - plain).abs().max() > 1e-3  # the bias moves the routing
    model = build_gpt(path)
    load_hf_weights(model, path)
    assert torch.equal(model.decoder.layers[1].mlp.router.expert_bias, state[name].float())
    ours = _megatron_logits(model, ids)
    assert (ours - biased).abs().max().item() <= 2e-5 * biased.abs().max().item()


def test_deepseek_v3_yarn_rope_equals_hf_transformers_and_differs_from_plain_rope(megatron_ws1, tmp_path):
    """tiny-deepseek_v3 carries DeepSeek-V3's YaRN (factor 32, mscale_all_dim 1: a softmax scale of
    (0.1·ln 32 + 1)² = 1.81 times 1/√24, and blended inverse frequencies). Over 100 tokens, beyond its 64
    original positions, Megatron's MLA with rope_type yarn gives transformers' logits; the same weights under
    plain RoPE give other logits (YaRN is exercised), also equal between the two."""
    ids = random_ids(2, 100)
    yarn = tiny_checkpoint("deepseek_v3")
    plain = with_config(tmp_path / "changed", "deepseek_v3",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    refs = {}
    for name, path in (("yarn", yarn), ("plain", plain)):
        model = build_gpt(path)
        load_hf_weights(model, path)
        refs[name] = hf_logits(path, ids)
        assert (_megatron_logits(model, ids) - refs[name]).abs().max().item() <= 2e-5 * refs[name].abs().max().item()
    # a random model's attention moves its logits little, but 100x beyond the equality tolerance above
    assert (refs["yarn"] - refs["plain"]).abs().max().item() > 100 * 2e-5 * refs["yarn"].abs().max().item()


def test_yarn_that_transformers_and_megatron_scale_differently_is_refused(megatron_ws1, tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 64,
            "mscale": 0.707}
    with pytest.raises(NotImplementedError, match="mscale 0.707 and no mscale_all_dim"):
        build_gpt(with_config(tmp_path / "changed", "deepseek_v3", rope_parameters=rope))


def test_an_upcycled_llama_in_megatron_computes_the_dense_model(megatron_ws1, tmp_path):
    """models/upcycle.py with exact copies as experts: Megatron's Mixtral (top-2 renormalised, our table) gives
    the dense Llama's logits, and its round trip to HF is exact."""
    dense = tiny_checkpoint("llama")
    moe = upcycle_checkpoint(dense, tmp_path / "moe", num_experts=4, top_k=2, noise=0.0, router_std=0.5)
    model = build_gpt(moe)
    load_hf_weights(model, moe)
    ids = random_ids(2, 24)
    ours, ref = _megatron_logits(model, ids), hf_logits(dense, ids)
    assert (ours - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    original = read_hf_state(moe)
    exported = dict(kv for bucket in export_hf_weights(model, moe, dtype=torch.bfloat16) for kv in bucket)
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def test_expert_bias_stays_fp32_through_the_push_the_smoothed_push_and_the_written_checkpoint(megatron_ws1, tmp_path):
    """DeepSeek-V3's e_score_correction_bias is fp32 in Megatron's router and in SGLang's gate: a bf16 copy
    would move near-tie routes after the first push. A bias no bf16 value equals (1 + 2^-12, ...) leaves the
    export, the smoothed push's cast and the HF checkpoint written by `qurl export` bit for bit, while the
    linears take the export's dtype."""
    from safetensors import safe_open

    from qurl_mcore.megatron.export import write_hf_checkpoint
    from qurl_mcore.smoothing import smooth_buckets

    path = tiny_checkpoint("deepseek_v3")
    model = build_gpt(path)
    load_hf_weights(model, path)
    name, router = "model.layers.1.mlp.gate.e_score_correction_bias", model.decoder.layers[1].mlp.router
    bias = 1 + torch.arange(1, 9, dtype=torch.float32) * 2.0**-12
    assert not torch.equal(bias.bfloat16().float(), bias)  # the test can fail: bf16 rounds this bias
    router.expert_bias.copy_(bias)
    exported = dict(kv for bucket in export_hf_weights(model, path, dtype=torch.bfloat16) for kv in bucket)
    assert exported[name].dtype == torch.float32 and torch.equal(exported[name], bias)
    assert exported["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    from qurl_mcore.megatron.convert import export_cast  # the cast the smoothed push applies after its fold

    raw = export_hf_weights(model, path, dtype=None)
    smoothed = dict(kv for b in smooth_buckets(raw, {}, {}, export_cast(path, torch.bfloat16)) for kv in b)
    assert torch.equal(smoothed[name], bias) and smoothed["model.embed_tokens.weight"].dtype == torch.bfloat16
    out = write_hf_checkpoint(model, path, tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(str(next(out.glob("model-*.safetensors"))), "pt") as f:
        assert torch.equal(f.get_tensor(name), bias)


def _variant(dst, extra):
    """A copy of tiny-deepseek_v3 (2 layers, the second MoE) with `extra(state)` applied to its tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_checkpoint("deepseek_v3"), dst)
    state = load_file(path / "model.safetensors")
    extra(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _with_mtp(state):
    """DeepSeek-V3's multi-token-prediction module: layer num_hidden_layers (2 here), beyond the config's."""
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    state["model.layers.2.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)


def _fp8(state):
    """DeepSeek-V3's published format: an FP8 E4M3 weight and its fp32 scale per 128x128 block."""
    name = "model.layers.0.self_attn.o_proj.weight"
    w = state[name].float()
    state[name] = w.to(torch.float8_e4m3fn)
    state[name + "_scale_inv"] = torch.ones(-(-w.shape[0] // 128), -(-w.shape[1] // 128))


def test_an_fp8_checkpoint_and_mtp_layers_are_refused_by_name(megatron_ws1, tmp_path):
    """An FP8 checkpoint loads as its codes without their block scales unless refused, MTP tensors would be
    dropped without a word: both are refused naming what they are and the fix."""
    for extra, said in ((_fp8, "an FP8 checkpoint"), (_with_mtp, "multi-token-prediction (MTP)")):
        path = _variant(tmp_path / extra.__name__, extra)
        with pytest.raises(ValueError, match=re.escape(said)):
            load_hf_weights(build_gpt(path), path)


@pytest.mark.slow  # two processes that import Megatron
def test_mtp_layers_and_fp8_scales_are_refused_at_expert_parallel_2(tmp_path):
    """At EP=2 no rank reads every tensor, so the unused-tensor guard cannot run there; both refusals do, on
    every rank, while the plain checkpoint loads."""
    from qurl_mcore.megatron.parallel import spawn

    from . import workers

    paths = [str(_variant(tmp_path / f.__name__, f)) for f in (_with_mtp, _fp8)] + [str(tiny_checkpoint("deepseek_v3"))]
    for mtp, fp8, plain in spawn(workers.refusals, 2, paths):
        assert "multi-token-prediction (MTP)" in mtp and "an FP8 checkpoint" in fp8 and plain == ""
