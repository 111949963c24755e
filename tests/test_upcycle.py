"""Sparse upcycling (models/upcycle.py): the MoE made from a dense Llama computes the dense model when its experts
are exact copies (renormalised top-k weights sum to 1), and its noise and router have the stated sizes."""
from __future__ import annotations

import json

import pytest
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.models.upcycle import upcycle_checkpoint, upcycle_state, upcycled_config

from .megatron.helpers import hf_logits, random_ids


def _dense_state(layers=2, hidden=64, inter=96, vocab=100):
    g = torch.Generator().manual_seed(1)
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        state[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.05
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden)
    return state


def test_without_noise_the_upcycled_moe_computes_the_dense_model(tmp_path):
    dense = tiny_checkpoint("llama")
    moe = upcycle_checkpoint(dense, tmp_path / "moe", num_experts=4, top_k=2, noise=0.0, router_std=0.5)
    config = json.loads((moe / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    ids = random_ids(2, 16)
    ours, ref = hf_logits(moe, ids), hf_logits(dense, ids)
    # a router of std 0.5 picks different experts for different tokens; copies make the choice irrelevant
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_noise_and_router_have_the_stated_sizes_and_a_seed_fixes_them():
    state = _dense_state()
    make = lambda seed: upcycle_state(state, 8, 0.01, 1e-3, torch.Generator().manual_seed(seed), tied=True)
    a, b, c = make(0), make(0), make(1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.block_sparse_moe.experts.0.w1.weight"],
                           c["model.layers.0.block_sparse_moe.experts.0.w1.weight"])
    for proj, name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        w = state[f"model.layers.1.mlp.{proj}.weight"]
        deltas = torch.stack([a[f"model.layers.1.block_sparse_moe.experts.{e}.{name}.weight"] - w for e in range(8)])
        assert deltas.std().item() == pytest.approx(0.01 * w.std().item(), rel=0.05)
        assert abs(deltas.mean().item()) < 1e-3 * w.std().item()
        assert all(not torch.equal(deltas[0], deltas[e]) for e in range(1, 8))  # the symmetry is broken
    router = a["model.layers.0.block_sparse_moe.gate.weight"]
    assert router.shape == (8, 64) and router.std().item() == pytest.approx(1e-3, rel=0.1)
    assert torch.equal(a["lm_head.weight"], state["model.embed_tokens.weight"])
    assert not any(".mlp." in k for k in a) and torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(64))


def test_what_cannot_be_upcycled_is_refused():
    with pytest.raises(ValueError, match="reads a Llama checkpoint; this one is 'qwen3_moe'"):
        upcycled_config({"model_type": "qwen3_moe"}, 4, 2)
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        upcycled_config({"model_type": "llama"}, 4, 5)
    with pytest.raises(ValueError, match="no Llama MLP weights"):
        upcycle_state({"model.embed_tokens.weight": torch.ones(2, 2)}, 4, 0.0, 0.0, torch.Generator(), tied=False)
