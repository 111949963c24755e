"""Adding an architecture is one table: a toy model type whose HF checkpoint names every weight differently from
Llama (same math) is registered in `ARCHITECTURES` and nothing else; the converter, the precision's linears, UAQ
and the SGLang plugin's layer selection then all follow its names."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig

from qurl_mcore.megatron.convert import export_hf_weights, load_hf_weights, read_hf_state
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.megatron.spec import linear_group
from qurl_mcore.models import llama, registry
from qurl_mcore.models.slots import Architecture, Slot
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import quantized_linears

from .helpers import random_ids


class ToyConfig(LlamaConfig):
    model_type = "toy-llama"


AutoConfig.register("toy-llama", ToyConfig, exist_ok=True)

#: Llama's HF names -> the toy's (layer-level names keep the {layer} placeholder)
_RENAMES = {
    "model.embed_tokens.weight": "tok.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight", "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.w1.weight", "mlp.up_proj.weight": "ffn.w3.weight", "mlp.down_proj.weight": "ffn.w2.weight",
}
_SGLANG = {"self_attn.qkv_proj": "attn.wqkv", "self_attn.o_proj": "attn.wo", "mlp.gate_up_proj": "ffn.w13",
           "mlp.down_proj": "ffn.w2"}


def _rename(name: str) -> str:
    if name in _RENAMES:
        return _RENAMES[name]
    prefix, rest = name.split(".", 3)[:3], name.split(".", 3)[3]  # model.layers.{layer}.rest
    return f"h.{prefix[2]}." + _RENAMES.get(rest, _SGLANG.get(rest, rest))


def _toy_slot(slot: Slot) -> Slot:
    return Slot(slot.megatron, tuple(_rename(t) for t in slot.hf), slot.layout, slot.group, slot.shapes,
                sglang=slot.sglang and _rename(slot.sglang), uaq=slot.uaq, needs=slot.needs, exported=slot.exported)


TOY = Architecture("toy-llama", tuple(_toy_slot(s) for s in llama.LLAMA.slots))


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """The toy registered (the one table touched) and a checkpoint of it: tiny-llama's weights under its names."""
    monkeypatch.setitem(registry.ARCHITECTURES, TOY.model_type, TOY)
    src = tiny_checkpoint("llama")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((src / "config.json").read_text()) | {"model_type": "toy-llama", "architectures": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    save_file({_rename(n): t for n, t in state.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, src


def test_the_converter_follows_the_table(toy, megatron_ws1):
    path, llama_path = toy
    model, reference = build_gpt(path), build_gpt(llama_path)
    load_hf_weights(model, path)
    load_hf_weights(reference, llama_path)
    exported = dict(kv for bucket in export_hf_weights(model, path, dtype=torch.bfloat16) for kv in bucket)
    original = read_hf_state(path)
    assert exported.keys() == original.keys() and "h.1.attn.wq.weight" in exported
    assert all(torch.equal(exported[k], original[k]) for k in original)
    ids = random_ids(2, 16)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        assert torch.equal(model(ids, positions, None), reference(ids, positions, None))


def test_every_other_part_reads_the_toy_names(toy):
    path, _ = toy
    groups = registry.hf_linears(path)
    assert groups["h.0.attn.wq"] == "attention" and groups["h.1.ffn.w2"] == "mlp" and len(groups) == 2 * 7
    assert quantized_linears(path, "int8", "all") == set(groups)
    assert quantized_linears(path, "fp4", "experts") == {n for n, g in groups.items() if g == "mlp"}
    assert [registry.hf_uaq_role(f"h.3.{n}") for n in ("attn_norm.weight", "attn.wv.weight", "ffn.w1.weight")] == \
        ["attn_norm", "v", "gate"]
    assert registry.sglang_linears("h.2.attn.wqkv") == ("attention", ["h.2.attn.wq", "h.2.attn.wk", "h.2.attn.wv"])
    assert registry.sglang_linears("h.2.ffn.w13") == ("mlp", ["h.2.ffn.w1", "h.2.ffn.w3"])
    assert linear_group("decoder.layers.0.mlp.linear_fc1.weight") == "mlp"  # Megatron's names are shared


def test_a_table_that_contradicts_another_is_refused(monkeypatch):
    qkv = next(s for s in llama.LLAMA.slots if s.group == "attention")
    wrong = Slot(qkv.megatron, qkv.hf, qkv.layout, "mlp", qkv.shapes)
    monkeypatch.setitem(registry.ARCHITECTURES, "bad", Architecture("bad", (wrong,)))
    with pytest.raises(ValueError, match="another meaning"):
        registry.megatron_slot("decoder.layers.0.self_attention.linear_qkv.weight")
