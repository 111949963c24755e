import json
import shutil

import pytest
import torch

from qurl_mcore.megatron.convert import export_hf_weights, load_hf_weights, read_hf_state
from qurl_mcore.megatron.logprobs import token_logprobs
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.megatron.rescaling import apply_uaq, quantized_weights, update_capture
from qurl_mcore.models.registry import features, hf_uaq_role, num_experts
from qurl_mcore.models.smollm2 import hf_checkpoint
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import SCOPES
from qurl_mcore.uaq import (UAQ_EXPONENTS, UAQ_ROLES, scale_per_head, uaq_exponent, uaq_scale_hf,
                           update_capture_ratio)

from .helpers import random_ids


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)


@pytest.mark.parametrize("s", [1.5, 2.0])
def test_uaq_preserves_multi_head_latent_attention(s, megatron_ws1):
    """DeepSeek-V3's MLA: kv_b_proj's k_nope rows and o_proj hold W/s, kv_b_proj's v rows W (v·s against o_proj/s),
    q_b_proj W, and the model computes the same; the export equals the HF-side table applied to the original."""
    path = tiny_checkpoint("deepseek_v3")
    hf = json.loads((path / "config.json").read_text())
    model = build_gpt(path)
    load_hf_weights(model, path)
    plain = {n: t.clone() for b in export_hf_weights(model, path) for n, t in b}  # an export may share storage
    ids = random_ids(2, 16)
    before = _logits(model, ids)
    # every parameter, not only the quantized ones: kv_b_proj (linear_kv_up_proj) stays full precision, and UAQ
    # rescales its k_nope rows all the same
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_uaq(model, s)
    after = _logits(model, ids)
    assert ((after - before).norm() / before.norm()).item() < 1e-5
    new = {n: p.detach() for n, p in model.named_parameters()}
    attn = "decoder.layers.0.self_attention."
    nope, v = hf["qk_nope_head_dim"], hf["v_head_dim"]
    kv = attn + "linear_kv_up_proj.weight"
    heads_new = new[kv].view(hf["num_attention_heads"], nope + v, -1)
    heads_old = weights[kv].view(hf["num_attention_heads"], nope + v, -1)
    assert torch.allclose(heads_new[:, :nope], heads_old[:, :nope] / s) and torch.equal(heads_new[:, nope:],
                                                                                        heads_old[:, nope:])
    assert torch.allclose(new[attn + "linear_proj.weight"], weights[attn + "linear_proj.weight"] / s)
    assert torch.equal(new[attn + "linear_q_up_proj.weight"], weights[attn + "linear_q_up_proj.weight"])
    scaled = dict(kv for b in export_hf_weights(model, path) for kv in b)
    for name, tensor in plain.items():
        torch.testing.assert_close(scaled[name], uaq_scale_hf(name, tensor, s, hf), rtol=1e-6, atol=0, msg=name)


def test_per_head_parts_take_their_roles_exponents():
    # heads of [k (1 row); v (2 rows)], s = 2: k rows / 2, v rows as they are
    t = torch.arange(12.0).view(6, 2)
    want = t.clone()
    want[[0, 3]] /= 2
    assert torch.equal(scale_per_head(t, "kv_b", (1, 2), 2.0), want)
    with pytest.raises(ValueError, match="are not heads of parts"):
        scale_per_head(t, "kv_b", (2, 2), 2.0)
    with pytest.raises(ValueError, match="pass the model's config"):
        uaq_scale_hf("model.layers.0.self_attn.kv_b_proj.weight", t, 2.0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2", "llama", "mixtral", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("s", [1.5, 2.0])
def test_uaq_preserves_the_function(arch, s, megatron_ws1):
    path = tiny_checkpoint(arch)
    model = build_gpt(path)
    load_hf_weights(model, path)
    ids = random_ids(2, 16)
    before = _logits(model, ids)
    weights = quantized_weights(model)
    changed = apply_uaq(model, s)
    after = _logits(model, ids)
    assert ((after - before).norm() / before.norm()).item() < 1e-5
    # and it did rescale: q rows of layer 0's linear_qkv (the first 2 of each 4-row-block group) by 1/s
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    new = dict(model.named_parameters())[qkv].detach().view(2, 4, 32, -1)
    old = weights[qkv].view(2, 4, 32, -1)
    assert torch.allclose(new[:, :2], old[:, :2] / s) and torch.equal(new[:, 3], old[:, 3])  # v net unchanged
    assert any("router" in n for n in changed) == (num_experts(path) > 0)
    assert any("linear_qkv.bias" in n for n in changed) == ("qkv_bias" in features(path))
    assert any("shared_experts.gate_weight" in n for n in changed) == ("shared_expert_gate" in features(path))


def test_hf_uaq_table_preserves_the_hf_model():
    """The same exponents applied to HF names leave transformers' own forward unchanged (SmolLM2, tied)."""
    from transformers import AutoModelForCausalLM

    path = hf_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_ids(1, 16)
    with torch.no_grad():
        before = model(ids).logits
        state = {k: uaq_scale_hf(k, v, 1.5) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        after = model(ids).logits
    assert ((after - before).norm() / before.norm()).item() < 1e-5
    assert hf_uaq_role("model.layers.3.mlp.experts.7.up_proj.weight") == "up"
    assert hf_uaq_role("model.layers.3.mlp.gate.weight") == "router"
    assert hf_uaq_role("model.embed_tokens.weight") is None
    assert set(UAQ_EXPONENTS.values()) <= {-1, 0, 1}


def test_hf_uaq_table_preserves_transformers_deepseek_v3(tmp_path):
    """The HF-side table on MLA (kv_b_proj split per head, its sizes from the checkpoint's config): a checkpoint
    rewritten with s = 1.5 (`unscale_hf_checkpoint` by 1/s, as verl's start does) loads into transformers' own
    DeepSeek-V3 and computes the same. (Through files: transformers 5 fuses the experts' tensors in memory.)"""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from qurl_mcore.megatron.export import unscale_hf_checkpoint

    path = tmp_path / "fp32"  # the tiny checkpoint in fp32, so that the rewrite is exact
    shutil.copytree(tiny_checkpoint("deepseek_v3"), path)
    for f in path.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    scaled = unscale_hf_checkpoint(path, tmp_path / "scaled", 1 / 1.5)
    ids = random_ids(1, 16)
    with torch.no_grad():
        before, after = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(ids).logits
                         for p in (path, scaled))
    assert ((after - before).norm() / before.norm()).item() < 1e-5
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    original, rewritten = (load_file(str(next(p.glob("*.safetensors"))))[kv_b] for p in (path, scaled))
    assert not torch.equal(original, rewritten)


def test_update_capture_ratio_counts_code_changes():
    w = torch.tensor([[1.0, 0.3, -0.25, 0.0]])  # int8 per channel: step 1/127, 0.3 -> code 38.1 -> 38
    assert update_capture_ratio(w, w.clone(), "int8") == 0.0
    nudged = w + torch.tensor([[0.0, 0.001, 0.0, 0.0]])  # an eighth of a step: not captured
    assert update_capture_ratio(w, nudged, "int8") == 0.0
    moved = w + torch.tensor([[0.0, 0.006, 0.0, 0.006]])  # > half a step on two entries
    assert update_capture_ratio(w, moved, "int8") == 0.5
    rescaled = w * 1.001  # the row maximum moves: scale changes, no code does
    assert update_capture_ratio(w, rescaled, "int8") == 0.0
    assert update_capture_ratio({"a": w, "b": w}, {"a": moved, "b": w}, "int8") == 0.25
    with pytest.raises(ValueError, match="differ in names"):
        update_capture_ratio({"a": w}, {"b": w}, "int8")


def test_update_capture_ratio_reads_the_host_once_whatever_the_tensor_count():
    """The metric runs once a step over every weight: its count stays on the device and is read once (a read a
    tensor is a GPU synchronization a tensor)."""
    from tests.host_syncs import HostReads

    before = {f"w{i}": torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    after = {k: v + 0.05 for k, v in before.items()}
    with HostReads() as reads:
        ratio = update_capture_ratio(before, after, "int8")
    assert reads.count == 1, reads.ops
    assert ratio == sum(int((update_capture_ratio(before[k], after[k], "int8") * v.numel()))
                        for k, v in before.items()) / sum(v.numel() for v in before.values())


def test_uaq_raises_the_update_capture_ratio_after_an_adam_step(megatron_ws1):
    path = tiny_checkpoint("qwen3_moe")
    model = build_gpt(path)
    load_hf_weights(model, path)
    ids = random_ids(4, 32, seed=1)
    reference = read_hf_state(path)["model.layers.0.self_attn.q_proj.weight"].float()

    ratios = update_capture(model, lambda m: -token_logprobs(m, ids, grad=True).logprobs.sum(),
                            scales=(1.0, 1.5, 2.0), fmts=("int8", "fp8_e4m3"))
    for fmt in ("int8", "fp8_e4m3"):
        base = ratios[1.0][fmt]
        factors = {s: ratios[s][fmt] / base for s in (1.5, 2.0)}
        print(f"{fmt}: capture {base:.4f}, UAQ factor s=1.5: {factors[1.5]:.2f}, s=2: {factors[2.0]:.2f}")
        assert 0 < base < 0.5
        assert 1.1 < factors[1.5] < factors[2.0] < 2.0  # between 1 (v, up rows unscaled) and s
    # the model is left as it was
    q = dict(model.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"].detach()
    assert torch.equal(q.view(2, 4, 32, -1)[:, :2].reshape(-1, 128), reference)


def _routed(model, ids):
    out = token_logprobs(model, ids, return_routed_experts=True)
    return out.logprobs, out.routed_experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_uaq_on_the_experts_is_the_mlp_blocks_part_of_uaq_and_keeps_function_and_routing(arch, megatron_ws1):
    """UAQ over scope "experts": pre_mlp_layernorm ·s, the experts' (and shared experts', a dense layer's MLP's)
    gate rows /s, up rows ·1, fc2 /s, the router and Qwen2-MoE's shared-expert gate /s, exactly the tensors the
    full UAQ gives them, and every attention tensor as it was. The model's log-probs stay within fp32 rounding and
    every token is routed to the same experts (the router's logits are (W/s)·(s·x))."""
    path = tiny_checkpoint(arch)
    model = build_gpt(path)
    load_hf_weights(model, path)
    ids = random_ids(2, 16)
    before, routes = _routed(model, ids)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = set(apply_uaq(model, 1.5, "experts"))
    experts = {n: p.detach().clone() for n, p in model.named_parameters()}
    after, routes_after = _routed(model, ids)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert torch.equal(routes_after, routes)

    apply_uaq(model, 1.5 ** -1, "experts")  # back, then the full UAQ for comparison
    apply_uaq(model, 1.5)
    full = {n: p.detach() for n, p in model.named_parameters()}
    mlp_block = {n for n in original if ".mlp." in n or "pre_mlp_layernorm" in n}
    assert changed == {n for n in mlp_block if not torch.equal(full[n], original[n])}
    assert {n.split(".mlp.")[-1].split(".")[0] for n in changed if ".mlp." in n} >= {"router", "experts"}
    assert any("pre_mlp_layernorm" in n for n in changed)
    for name in original:
        if name in changed:
            torch.testing.assert_close(experts[name], full[name], rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(experts[name], original[name]), name


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_hf_uaq_on_the_experts_matches_the_trainers_and_is_undone_on_export(arch, megatron_ws1):
    """The HF-named table over scope "experts" is what `apply_uaq(model, s, "experts")` exports (MLA's kv_b_proj
    and every attention tensor untouched), and an export with s⁻¹ over the same scope gives the weights back."""
    path = tiny_checkpoint(arch)
    hf = json.loads((path / "config.json").read_text())
    model = build_gpt(path)
    load_hf_weights(model, path)
    plain = {n: t.clone() for b in export_hf_weights(model, path) for n, t in b}
    apply_uaq(model, 1.5, "experts")
    scaled = {n: t.clone() for b in export_hf_weights(model, path) for n, t in b}
    for name, tensor in plain.items():
        want = uaq_scale_hf(name, tensor, 1.5, hf, "experts")
        torch.testing.assert_close(scaled[name], want, rtol=1e-6, atol=0, msg=name)
        assert torch.equal(want, tensor) == (uaq_exponent(hf_uaq_role(name), "experts") == 0), name
    back = dict(kv for b in export_hf_weights(model, path, uaq_scale=1 / 1.5, uaq_scope="experts") for kv in b)
    for name, tensor in plain.items():
        torch.testing.assert_close(back[name], tensor, rtol=1e-6, atol=0, msg=name)


def test_uaq_scopes_name_the_precision_scopes_and_roles_of_the_table():
    assert set(UAQ_ROLES) == set(SCOPES)
    assert UAQ_ROLES["experts"] < UAQ_ROLES["all"] == set(UAQ_EXPONENTS)
    assert uaq_exponent("q", "experts") == 0 and uaq_exponent("q", "all") == -1
    assert uaq_exponent("router", "experts") == -1 and uaq_exponent(None, "all") == 0
    with pytest.raises(ValueError, match="unknown UAQ scope 'attention'"):
        uaq_exponent("q", "attention")


def test_uaq_on_the_experts_raises_their_nvfp4_update_capture(megatron_ws1):
    """One Adam step (lr 1e-5) after UAQ over "experts": the share of the routed experts' NVFP4 codes that change
    grows with s, and by less than s (Adam's step does not grow with the gradient; up rows stay at ×1)."""
    path = tiny_checkpoint("qwen3_moe")
    model = build_gpt(path)
    load_hf_weights(model, path)
    ids = random_ids(4, 32, seed=1)
    ratios = update_capture(model, lambda m: -token_logprobs(m, ids, grad=True).logprobs.sum(),
                            scales=(1.0, 1.5, 2.0), fmts=("nvfp4",), granularity="block", uaq_scope="experts",
                            select=lambda name: ".mlp.experts." in name)
    base = ratios[1.0]["nvfp4"]
    factors = {s: ratios[s]["nvfp4"] / base for s in (1.5, 2.0)}
    print(f"nvfp4 experts: capture {base:.4f}, UAQ factor s=1.5: {factors[1.5]:.2f}, s=2: {factors[2.0]:.2f}")
    assert 0 < base < 0.5
    assert 1.1 < factors[1.5] < factors[2.0] < 2.0


def test_qurl_export_unscales_an_hf_checkpoint_scaled_on_the_experts(tmp_path):
    """An HF checkpoint UAQ-scaled over "experts" (as slime's hook leaves an FP4 run's `--save-hf`) comes back
    with `qurl export DIR OUT --uaq-scale s --uaq-scope experts`: the original tensors to fp32 rounding, and the
    attention's as they were, bitwise, at every step."""
    from safetensors.torch import load_file, save_file

    from qurl_mcore.cli import main
    from qurl_mcore.megatron.export import unscale_hf_checkpoint

    path = tmp_path / "fp32"
    shutil.copytree(tiny_checkpoint("qwen2_moe"), path)
    for f in path.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    scaled = unscale_hf_checkpoint(path, tmp_path / "scaled", 1 / 1.5, "experts")
    assert main(["export", str(scaled), str(tmp_path / "back"), "--uaq-scale", "1.5", "--uaq-scope", "experts"]) == 0
    (original, rescaled, back) = ({k: v for f in sorted(p.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
                                  for p in (path, scaled, tmp_path / "back"))
    for name, tensor in original.items():
        torch.testing.assert_close(back[name], tensor, rtol=1e-6, atol=0, msg=name)
        assert torch.equal(rescaled[name], tensor) == (".mlp." not in name and "post_attention_layernorm" not in name
                                                       or "up_proj" in name), name


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_uaq_on_the_experts_with_a_power_of_two_is_exact_in_bf16(arch, megatron_ws1):
    """A bf16 model: with s = 2 every product γ·s, W/s is exact in binary floating point, so the folded model
    gives the same log-probs and routes, bit for bit (s = 1.5 rounds γ·s and W_r/s: docs/megatron.md)."""
    path = tiny_checkpoint(arch)
    model = build_gpt(path, dtype=torch.bfloat16)
    load_hf_weights(model, path)
    ids = random_ids(4, 32)
    before, routes = _routed(model, ids)
    apply_uaq(model, 2.0, "experts")
    after, routes_after = _routed(model, ids)
    assert torch.equal(after, before) and torch.equal(routes_after, routes)
