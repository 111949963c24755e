"""The precision table: one name per way of running both sides, and the same linears quantized on both;
the recipe resolved from it once.

The symmetry tests build the real Megatron model (every precision x scope x architecture, in this process)
and start real SGLang engines (`slow`: one per architecture x scope), and compare the linears each
quantizes with `quantized_linears`, the table's answer.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from qurl_mcore.models import ARCHITECTURES
from qurl_mcore.models.registry import hf_linears
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import (
    ALIGNMENT_ROWS, FP4_FORMATS, METHODS, PRECISIONS, SCOPES, default_scope, get_precision, markdown_table,
    quantized_linears, select,
)
from qurl_mcore.recipe import engine_recipe, resolve

DOC = Path(__file__).parents[1] / "docs" / "precision.md"


def test_every_row_names_real_methods_modes_and_formats():
    from qurl_mcore.quant import FORMATS, MODES

    for p in PRECISIONS.values():
        assert p.train in MODES and p.scope in SCOPES
        assert p.rollout is None or p.rollout in METHODS
        assert all(f in FORMATS for f in p.formats)
        assert p.kind in ("reference", "QuRL", "symmetric", "ablation")
        if p.kind == "symmetric":  # both sides run the same numerics in the forward
            assert resolve(p.name).train.fmt == engine_recipe(p.rollout).spec.fmt
            assert resolve(p.name).train.rc_forward == engine_recipe(p.rollout).spec.rc_forward
    assert [PRECISIONS[n].kind for n in ALIGNMENT_ROWS] == ["reference", "symmetric", "ablation", "ablation",
                                                            "symmetric"]
    assert {p.name: p.uaq for p in PRECISIONS.values() if p.uaq} == {"int8": "all", "fp8": "all", "fp4": "experts",
                                                                     "fp4_rc": "experts"}


def test_select_fills_defaults_and_refuses_what_a_precision_does_not_take():
    assert select("int8") == (PRECISIONS["int8"], "all", "int8")
    assert select("fp4_rc", "auto", "mxfp4") == (PRECISIONS["fp4_rc"], "experts", "mxfp4")
    assert select("bf16", "experts") == (PRECISIONS["bf16"], "experts", None)
    for choose in (select, resolve):  # the recipe is built on the same choice
        with pytest.raises(ValueError, match="unknown precision 'rc_training'"):
            choose("rc_training")
        with pytest.raises(ValueError, match="unknown scope 'attention'"):
            choose("fp4", "attention")
        with pytest.raises(ValueError, match=r"precision 'int8' runs in \['int8'\], not 'nvfp4'"):
            choose("int8", "all", "nvfp4")
    assert default_scope("qurl_int8") == "all" and default_scope("qurl_fp4_rc") == "experts"
    assert get_precision("fp4_rc_rollout").rollout == "qurl_fp4_rc"


def test_a_recipe_holds_both_sides():
    from qurl_mcore.quant import FORMATS, Family, make_spec

    r = resolve("fp4_rc_rollout", fmt="mxfp4")
    assert (r.precision, r.scope, r.fmt, r.format) == (PRECISIONS["fp4_rc_rollout"], "experts", "mxfp4",
                                                       FORMATS["mxfp4"])
    assert r.train == make_spec("rc_none", "mxfp4") and r.train_groups == {"experts", "mlp"}
    assert (r.engine.method, r.engine.spec) == ("qurl_fp4_rc", make_spec("rc_forward", "mxfp4"))
    assert r.groups("rollout") == r.groups("train") == SCOPES["experts"]
    quru = resolve("int8")  # QuRL: a full-precision trainer, quantized engines on every group
    assert not quru.train.quantized and quru.groups("train") == frozenset()
    assert quru.groups("rollout") == SCOPES["all"] and not quru.te
    bf16 = resolve("bf16", "all")
    assert bf16.engine is None and bf16.format is None and bf16.groups("rollout") == bf16.groups("train") == set()
    with pytest.raises(ValueError, match="side must be 'rollout' or 'train'"):
        bf16.groups("engine")
    # the engines' half is what an engine builds from its method and options alone
    assert r.engine == engine_recipe("qurl_fp4_rc", "mxfp4", "experts")
    assert engine_recipe("qurl_int8") == quru.engine
    with pytest.raises(ValueError, match="unknown qurl quantization method 'qurl_int4'"):
        engine_recipe("qurl_int4")
    with pytest.raises(ValueError, match=r"qurl_fp8 runs in \['fp8_e4m3'\], not 'nvfp4'"):
        engine_recipe("qurl_fp8", "nvfp4")
    assert FP4_FORMATS == tuple(n for n, f in FORMATS.items() if f.family is Family.FP4)


def test_linear_sets_by_hand():
    """Tiny models: 2 layers, q/k/v/o attention; dense MLPs gate/up/down; the MoE has 4 experts."""
    moe, dense = tiny_checkpoint("qwen3_moe"), tiny_checkpoint("qwen3")
    assert len(quantized_linears(moe, "fp4_rc", "experts")) == 2 * 4 * 3
    assert len(quantized_linears(moe, "fp4_rc", "all")) == 2 * 4 * 3 + 2 * 4
    assert len(quantized_linears(dense, "int8", "experts")) == 2 * 3  # a dense model's MLP is its expert
    assert len(quantized_linears(dense, "int8", "all")) == 2 * 3 + 2 * 4
    assert quantized_linears(dense, "int8", side="train") == set()  # QuRL trains in full precision
    assert quantized_linears(dense, "bf16") == set()
    assert "model.layers.1.mlp.experts.3.down_proj" in quantized_linears(moe, "fp4")
    assert not any(".mlp.gate" == n[-9:] for n in hf_linears(moe))  # the router is never a candidate


def test_the_doc_table_is_the_table():
    assert markdown_table() in DOC.read_text(), "regenerate docs/precision.md's table from markdown_table()"


CASES = list(itertools.product(ARCHITECTURES, PRECISIONS, SCOPES))


@pytest.mark.parametrize("arch,precision,scope", CASES, ids=["-".join(c) for c in CASES])
def test_megatron_quantizes_the_tables_linears(megatron_ws1, arch, precision, scope):
    from qurl_mcore.megatron import build_gpt
    from qurl_mcore.megatron import quantized_linears as megatron_quantized

    path = tiny_checkpoint(arch)
    model = build_gpt(path, recipe=resolve(precision, scope))
    assert megatron_quantized(model, path) == quantized_linears(path, precision, scope, side="train")


# one engine per architecture; scopes and methods take turns, so each scope runs on four architectures (both on
# models with shared experts: qwen2_moe and glm4_moe "all", deepseek_v3 "experts") and each method on two. The
# scope's selection is the same table code for every architecture; the trainer's side above runs every triple.
ENGINES = list(zip(ARCHITECTURES, itertools.cycle(SCOPES), itertools.cycle(METHODS)))


@pytest.mark.slow
@pytest.mark.parametrize("arch,scope,method", ENGINES, ids=["-".join(c) for c in ENGINES])
def test_sglang_quantizes_the_tables_linears(arch, scope, method, tmp_path, monkeypatch):
    from qurl_mcore.sglang.options import QUANTIZED_LOG_ENV
    from tests.sglang.conftest import local_engine

    log = tmp_path / "quantized.txt"
    log.touch()
    monkeypatch.setenv(QUANTIZED_LOG_ENV, str(log))
    path = str(tiny_checkpoint(arch))
    with local_engine(path, method, {"scope": scope}) as engine:
        assert engine.generate([[1, 2, 3]], {"max_new_tokens": 1})[0].output_ids  # it serves
    got = set(log.read_text().split())
    for precision in (p for p in PRECISIONS.values() if p.rollout == method):
        assert got == quantized_linears(path, precision.name, scope, side="rollout"), precision.name
