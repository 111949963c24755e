"""The code push's trainer half, without engines: the wire format, units, the bucket stream, digests, the refit
comparison and where code pushes serve (tests/rollout/test_code_push_engine.py pushes into real engines)."""
from __future__ import annotations

import types

import pytest
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.quant import quantize_weight
from qurl_mcore.quant.formats import E4M3_MAX
from qurl_mcore.quant.wire import (COLUMNS, GLOBAL_SCALE, ROWS, SCALE, Unit, digest, encode_unit, shard, unit_digest,
                                   wire_specs)
from qurl_mcore.recipe import engine_recipe
from qurl_mcore.config import load_config
from qurl_mcore.rollout.codes import CodePush, compare_digests, engine_units, push_specs

#: the engines' weight recipes, one per format
SPECS = {fmt: engine_recipe(method, fmt, "all").spec for method, fmt in (
    ("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"), ("qurl_fp4", "mxfp4"),
    ("qurl_fp4", "hif4"))}


def _members(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"l.{n}_proj.weight", (torch.randn(rows, 96, generator=gen) * scale).to(torch.bfloat16))
            for n, rows, scale in (("q", 64, 1.0), ("k", 32, 3.0), ("v", 32, 0.1))]


@pytest.mark.parametrize("split,shards", [(ROWS, 1), (ROWS, 2), (COLUMNS, 2)])
@pytest.mark.parametrize("fmt", SPECS)
def test_wire_specs_describe_what_encode_unit_sends(fmt, split, shards):
    wire, _ = encode_unit(_members(), SPECS[fmt], split=split, shards=shards)
    sent = {n: (t.dtype, list(t.shape)) for n, t in wire}
    expected = {}
    for name, w in _members():
        expected.update(wire_specs(name, list(w.shape), SPECS[fmt], split, shards))
    assert sent == expected
    assert (GLOBAL_SCALE in "".join(sent)) == (fmt == "nvfp4")


@pytest.mark.parametrize("split", [ROWS, COLUMNS])
@pytest.mark.parametrize("fmt", SPECS)
def test_each_engine_shard_reads_the_codes_of_its_own_quantization(fmt, split):
    """TP 2: narrowed for rank r as SGLang's loaders narrow a full weight (the r-th half of its rows, of a
    row-parallel one's columns; a global scale: the r-th of [2]), the wire holds bitwise Q(rank r's shard of the
    unit): per-channel scales over the shard's columns, NVFP4's global scale over the shard's rows."""
    spec, members = SPECS[fmt], _members()
    wire = dict(encode_unit(members, spec, split=split, shards=2)[0])
    names = tuple(n for n, _ in members)
    push = CodePush(spec, dict.fromkeys(names, Unit(names, split, 2)))
    list(push.buckets([members]))
    owns = [quantize_weight(torch.cat([w.chunk(2, split)[r] for _, w in members]), spec) for r in range(2)]
    assert push.digests == {names[0]: unit_digest([digest(q) for q in owns])}  # the refit check's, per shard
    for r, own in enumerate(owns):
        codes = torch.cat([wire[n].chunk(2, split)[r] for n, _ in members])
        scales = torch.cat([wire[n + SCALE].chunk(2, split)[r] for n, _ in members])
        assert torch.equal(codes.view(torch.uint8), own.data.view(torch.uint8))
        assert torch.equal(scales.view(torch.uint8), own.scale.view(torch.uint8))
        if fmt == "nvfp4":
            assert all(torch.equal(wire[n + GLOBAL_SCALE][r], own.global_scale) for n, _ in members)
    whole = quantize_weight(members[0][1], spec)
    if split == COLUMNS and fmt in ("int8", "fp8_e4m3"):  # per-channel: each column shard has its own scales
        assert wire[members[0][0] + SCALE].shape == (64, 2)
        assert not torch.equal(wire[members[0][0] + SCALE][:, :1], whole.scale)
    with pytest.raises(ValueError, match="cannot split 96 columns into 5 equal engine shards"):
        shard(members[0][1], COLUMNS, 0, 5)


@pytest.mark.parametrize("fmt", SPECS)
def test_members_codes_dequantize_to_the_fused_rows_the_engine_quantizes(fmt):
    """Loaded row by row into one tensor, the wire codes and scales are Q(fused W): the same values as a
    quantization of the fused rows, and (row-grouped scales) each member's own quantization except for NVFP4,
    whose per-tensor scale is the unit's: amax(all rows) / (6 · 448)."""
    spec, members = SPECS[fmt], _members()
    wire = dict(encode_unit(members, spec)[0])
    fused = quantize_weight(torch.cat([w for _, w in members]), spec)
    assert torch.equal(torch.cat([wire[n].view(torch.uint8) for n, _ in members]), fused.data.view(torch.uint8))
    assert torch.equal(torch.cat([wire[n + SCALE].view(torch.uint8) for n, _ in members]),
                       fused.scale.view(torch.uint8))
    for name, w in members:
        alone = quantize_weight(w, spec)
        if fmt == "nvfp4":
            amax = max(float(x.float().abs().max()) for _, x in members)
            assert float(wire[name + GLOBAL_SCALE]) == pytest.approx(amax / (6 * E4M3_MAX), rel=1e-6)
        else:
            assert torch.equal(wire[name].view(torch.uint8), alone.data.view(torch.uint8))


def test_a_unit_split_over_buckets_is_sent_once_whole_and_the_rest_in_full_precision():
    spec = SPECS["int8"]
    (q, k, v), norm = _members(), ("l.norm.weight", torch.ones(96))
    units = dict.fromkeys((q[0], k[0], v[0]), Unit((q[0], k[0], v[0])))
    push = CodePush(spec, units)
    out = list(push.buckets([[norm, q], [k, v]]))
    assert [n for n, _ in out[0]] == ["l.norm.weight"] and out[0][0][1] is norm[1]
    assert [n for n, _ in out[1]] == [f"{m}{s}" for m in (q[0], k[0], v[0]) for s in ("", SCALE)]
    assert list(push.digests) == [q[0]]
    assert push.digests[q[0]] == digest(quantize_weight(torch.cat([q[1], k[1], v[1]]), spec))
    bf16 = CodePush(spec, units, send=False)
    assert [n for b in bf16.buckets([[norm, q], [k, v]]) for n, _ in b] == ["l.norm.weight", q[0], k[0], v[0]]
    assert bf16.digests == push.digests


def test_a_partial_push_sends_the_rows_it_has_and_nvfp4_refuses_half_a_unit():
    (q, k, v) = _members()
    units = dict.fromkeys((q[0], k[0], v[0]), Unit((q[0], k[0], v[0])))
    int8 = CodePush(SPECS["int8"], units)
    (bucket,) = list(int8.buckets([[k]]))
    assert torch.equal(dict(bucket)[k[0]], quantize_weight(k[1], SPECS["int8"]).data)
    assert not int8.digests  # the engine's unit holds rows this push did not carry
    with pytest.raises(ValueError, match=r"nvfp4 needs whole units: l.q_proj.weight is missing"):
        list(CodePush(SPECS["nvfp4"], units).buckets([[k]]))


def test_digest_sees_one_code_and_a_swap_of_rows():
    w = torch.randn(64, 96)
    q = quantize_weight(w, SPECS["nvfp4"])
    base = digest(q)
    assert digest(quantize_weight(w.clone(), SPECS["nvfp4"])) == base
    flipped = q.data.clone()
    flipped[3, 5] ^= 1
    assert digest(type(q)(flipped, q.scale, q.fmt, q.granularity, q.shape, q.dtype, q.global_scale)) != base
    swapped = q.data[[1, 0, *range(2, 64)]]
    assert digest(type(q)(swapped, q.scale, q.fmt, q.granularity, q.shape, q.dtype, q.global_scale)) != base
    scale = q.scale.clone().view(torch.uint8)
    scale[0, 0, 0] ^= 1
    assert digest(type(q)(q.data, scale.view(q.scale.dtype), q.fmt, q.granularity, q.shape, q.dtype,
                          q.global_scale)) != base


def test_the_refit_check_names_a_layer_quantized_on_one_side_only():
    """verl PR 7519's case: one side quantizes a layer the other keeps in full precision."""
    (q, k, v) = _members()
    spec = SPECS["int8"]
    units = {n: Unit((n,)) for n in (q[0], k[0], v[0])}
    push = CodePush(spec, units)
    list(push.buckets([[q, k, v]]))
    installed = dict(push.digests)
    assert compare_digests(push, installed) == []
    engine_extra = {**installed, "l.o_proj.weight": "0"}
    assert compare_digests(push, engine_extra) == ["l.o_proj.weight: quantized by the engine only (the trainer "
                                                   "holds it in full precision)"]
    del installed[k[0]]
    assert compare_digests(push, installed) == ["l.k_proj.weight: quantized by the trainer only (the engine holds "
                                                "it in full precision)"]
    installed[k[0]], installed[v[0]] = push.digests[k[0]], push.digests[q[0]]
    assert compare_digests(push, installed) == ["l.v_proj.weight: the engine's codes differ from the trainer's"]


def test_engine_units_are_sglangs_fused_modules_per_layer_and_expert():
    path = tiny_checkpoint("qwen3_moe")
    units = engine_units(path, engine_recipe("qurl_int8", "int8", "all").groups)
    a, e = "model.layers.1.self_attn.", "model.layers.1.mlp.experts.2."
    assert units[a + "k_proj.weight"] == Unit((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"))
    assert units[a + "o_proj.weight"] == Unit((a + "o_proj.weight",), COLUMNS)
    assert units[e + "up_proj.weight"] == Unit((e + "gate_proj.weight", e + "up_proj.weight"))
    assert units[e + "down_proj.weight"] == Unit((e + "down_proj.weight",), COLUMNS)
    # TP 2: every rank a shard of each; EP 2 of TP 2: experts whole (expert TP 1), attention still split
    tp2, ep2 = (engine_units(path, engine_recipe("qurl_int8", "int8", "all").groups, 2, ep) for ep in (1, 2))
    assert tp2[a + "o_proj.weight"].shards == tp2[e + "down_proj.weight"].shards == 2
    assert ep2[a + "o_proj.weight"].shards == 2 and ep2[e + "down_proj.weight"].shards == 1
    with pytest.raises(ValueError, match=r"expert parallelism \(2\) must divide its tensor parallelism \(1\)"):
        engine_units(path, engine_recipe("qurl_int8", "int8", "all").groups, 1, 2)
    assert not any("gate.weight" in n or "norm" in n or "embed" in n for n in units)  # router, norms: full precision
    experts_only = engine_units(path, engine_recipe("qurl_fp4", "nvfp4", "experts").groups)
    assert experts_only and all(".mlp.experts." in n for n in experts_only)
    specs = push_specs({e + "up_proj.weight": [32, 64], "model.norm.weight": [64]}, SPECS["mxfp4"], units)
    assert specs == {e + "up_proj.weight": (torch.uint8, [32, 32]),
                     e + "up_proj.weight" + SCALE: (torch.uint8, [32, 2, 1]), "model.norm.weight": (None, [64])}


def test_code_pushes_serve_every_layout_and_mla_but_not_replicated_nvfp4_heads():
    def mode(*over: str, kv_heads: int = 4) -> str:
        model = types.SimpleNamespace(heads=8, kv_heads=kv_heads)  # the Shape fields push_mode reads
        return load_config(None, list(over)).push_mode(model)

    assert mode("precision=int8") == "bf16"  # the default: configs choose codes (the shipped ones auto)
    assert mode("precision=int8", "rollout.push=auto") == "codes"
    assert mode("precision=bf16", "rollout.push=codes") == "bf16"  # nothing to quantize
    assert mode("precision=int8", "rollout.push=bf16") == "bf16"
    assert mode("precision=int8", "rollout.tp_size=2", "rollout.push=codes") == "codes"
    # 8 engine ranks share 4 k/v heads: each pair's NVFP4 q/k/v units differ in their global scale
    assert mode("precision=int8", "rollout.tp_size=8", "rollout.push=codes") == "codes"
    with pytest.raises(ValueError, match="rollout.tp_size 8 replicates the model's 4 k/v heads, which nvfp4 "
                                         "quantizes with each rank's own global scale: use rollout.tp_size=4"):
        mode("precision=fp4", "scope=all", "fp4_format=nvfp4", "rollout.tp_size=8", "rollout.push=codes")
    assert mode("precision=fp4", "scope=all", "fp4_format=mxfp4", "rollout.tp_size=8", "rollout.push=codes") == "codes"
    assert mode("precision=fp4", "fp4_format=nvfp4", "rollout.tp_size=8", "rollout.push=codes") == "codes"  # experts
    # broadcast pushes carry codes as tensor pushes do; and where auto cannot, it pushes BF16
    assert mode("precision=int8", "layout=disaggregated", "rollout.tp_size=8", "rollout.push=codes") == "codes"
    assert mode("precision=fp4", "scope=all", "fp4_format=nvfp4", "rollout.tp_size=8", "layout=disaggregated",
                "rollout.push=auto") == "bf16"


def test_an_mla_code_push_sends_kv_b_proj_in_full_precision_beside_the_codes():
    """DeepSeek-V3 under scope all pushes codes: q_b_proj and o_proj as codes, and kv_b_proj, whose full-precision
    values the engine rebuilds MLA's decode weights from, as it is (no unit: the engine does not quantize it)."""
    from qurl_mcore.models.registry import shape
    from qurl_mcore.sizing import model_config

    cfg = load_config(None, ["model.path=tiny-deepseek_v3", "precision=int8", "scope=all", "rollout.push=codes"])
    assert cfg.push_mode(shape(model_config(cfg.model.path)[0])) == "codes"
    units = engine_units(tiny_checkpoint("deepseek_v3"), cfg.recipe().engine.groups)
    attn = "model.layers.0.self_attn."
    assert {attn + "q_b_proj.weight", attn + "o_proj.weight"} <= units.keys()
    assert not [n for n in units if "kv_b_proj" in n or "_a_proj" in n]
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    (out,) = CodePush(cfg.recipe().engine.spec, units).buckets([[(attn + "kv_b_proj.weight", w)]])
    assert [(n, t.dtype) for n, t in out] == [(attn + "kv_b_proj.weight", torch.bfloat16)] and torch.equal(out[0][1], w)


def test_a_session_loads_codes_into_the_storage_that_serves_and_leaves_nothing_behind():
    """The engine's half without an engine: `attach_codes` registers Parameters over the installed QTensor, a
    loader writes a pushed expert's rows through them (gate rows first, up rows second, another EP rank's expert
    skipped), `detach_codes` takes them off again."""
    from qurl_mcore.sglang import weights
    from qurl_mcore.sglang.moe import expert_rows_loader

    spec = SPECS["nvfp4"]
    experts = [quantize_weight(torch.randn(8, 32), spec) for _ in range(2)]
    stacked, _ = weights.stack(experts)
    layer = torch.nn.Module()
    layer._map_global_expert_id_to_local_expert_id = lambda e: e - 2 if e >= 2 else -1  # this rank: experts 2, 3
    layer.moe_tp_rank, layer.moe_tp_size = 0, 1
    load = expert_rows_loader(layer, "w13_weight")
    weights.attach_codes(layer, "w13_weight", stacked, load, load)
    assert {n for n, _ in layer.named_parameters()} == {"w13_weight", "w13_weight_scale", "w13_weight_global_scale"}
    assert layer.w13_weight.data_ptr() == stacked.data.data_ptr()
    gate, up = torch.randn(4, 32), torch.randn(4, 32) * 5
    wire = dict(encode_unit([("gate", gate), ("up", up)], spec)[0])
    for shard, name in (("w1", "gate"), ("w3", "up")):
        for suffix in ("", SCALE, GLOBAL_SCALE):
            param = getattr(layer, "w13_weight" + suffix)
            param.weight_loader(param, wire[name + suffix], "w13", shard, expert_id=3)
            param.weight_loader(param, wire[name + suffix].clone().zero_(), "w13", shard, expert_id=0)  # skipped
    assert weights.detach_codes(layer) and not list(layer.named_parameters())
    assert not weights.detach_codes(layer)
    fused = quantize_weight(torch.cat([gate, up]), spec)
    assert torch.equal(stacked.data[1], fused.data) and torch.equal(stacked.data[0], experts[0].data)
    assert torch.equal(stacked.scale[1].view(torch.uint8), fused.scale.view(torch.uint8))
    assert torch.equal(stacked.global_scale[1], fused.global_scale)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_the_expert_loader_takes_its_expert_tp_ranks_rows_and_columns(fmt):
    """Expert TP 2, rank 1: the loader writes Q(rank 1's half of gate; of up) into w13 and Q(rank 1's half of
    down's columns) into w2, as SGLang's FusedMoE narrows the full-precision experts, global scales included."""
    from qurl_mcore.sglang import weights
    from qurl_mcore.sglang.moe import expert_rows_loader

    spec = SPECS[fmt]
    gen = torch.Generator().manual_seed(2)
    gate, up, down = (torch.randn(rows, cols, generator=gen) for rows, cols in ((8, 64), (8, 64), (64, 16)))
    layer = torch.nn.Module()
    layer._map_global_expert_id_to_local_expert_id = lambda e: e
    layer.moe_tp_rank, layer.moe_tp_size = 1, 2
    for name, members, split in (("w13_weight", [("gate", gate), ("up", up)], ROWS),
                                 ("w2_weight", [("down", down)], COLUMNS)):
        fused = torch.cat([w.chunk(2, split)[1] for _, w in members])
        mine = quantize_weight(fused, spec)
        stacked, _ = weights.stack([quantize_weight(torch.randn(fused.shape, generator=gen), spec)])
        load = expert_rows_loader(layer, name)
        weights.attach_codes(layer, name, stacked, load, load)
        wire = dict(encode_unit(members, spec, split=split, shards=2)[0])
        for (member, _), shard_id in zip(members, ("w1", "w3") if split == ROWS else ("w2",)):
            for suffix in ("", SCALE, GLOBAL_SCALE) if fmt == "nvfp4" else ("", SCALE):
                param = getattr(layer, name + suffix)
                param.weight_loader(param, wire[member + suffix], name, shard_id, expert_id=0)
        weights.detach_codes(layer)
        assert torch.equal(stacked.data[0].view(torch.uint8), mine.data.view(torch.uint8)), name
        assert torch.equal(stacked.scale[0].view(torch.uint8), mine.scale.view(torch.uint8)), name
        if fmt == "nvfp4":
            assert torch.equal(stacked.global_scale[0], mine.global_scale), name
