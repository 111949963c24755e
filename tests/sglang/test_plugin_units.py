"""The plugin's pieces without an engine: options, registration, master-weight bookkeeping."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from qurl_mcore.models.registry import hf_linears, num_experts, sglang_linears
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.quant import PerBlock, make_spec, quantize_weight, quantized_linear
from qurl_mcore.recipe import engine_recipe, resolve
from qurl_mcore.sglang import METHODS, QurlOptions, register
from qurl_mcore.sglang import weights
from qurl_mcore.sglang.architecture import checkpoint_prefix, fused_moe_class


def test_options_defaults_and_validation():
    assert QurlOptions.parse("qurl_int8").recipe.spec == make_spec("rc_none", "int8")
    assert QurlOptions.parse("qurl_fp8").recipe.spec == make_spec("rc_none", "fp8_e4m3")
    assert QurlOptions.parse("qurl_fp4").fmt == "nvfp4"
    rc = QurlOptions.parse("qurl_fp4_rc", {"quant_method": "qurl_fp4_rc", "fmt": "mxfp4", "scope": "experts",
                                           "packed_modules_mapping": {}, "hf_config": None})
    assert rc.recipe.spec == make_spec("rc_forward", "mxfp4") and rc.scope == "experts"
    # the engine's half of the recipe, built from the method and options alone, is the trainer side's
    assert rc.recipe == resolve("fp4_rc", "experts", "mxfp4").engine == resolve("fp4_rc_rollout", fmt="mxfp4").engine
    assert (rc.method, rc.fmt, rc.recipe.groups) == ("qurl_fp4_rc", "mxfp4", {"experts", "mlp"})
    # default scopes come from the precision table: W8A8 everywhere, FP4 on the experts (MoEResQ)
    assert QurlOptions.parse("qurl_int8").scope == "all" and QurlOptions.parse("qurl_fp4_rc").scope == "experts"
    for bad in ({"fmt": "int4"}, {"scope": "attention"}, {"kernel": "cutlass"}, {"master": "disk"}, {"bits": 4},
                {"requant": "jit"}, {"quant_method": "qurl_fp4"}):
        with pytest.raises(ValueError):
            QurlOptions.parse("qurl_fp4_rc", bad)
    with pytest.raises(ValueError, match="always uses int8"):
        QurlOptions.parse("qurl_int8", {"fmt": "fp8_e4m3"})
    assert QurlOptions.parse("qurl_fp4_rc", rc.override_args()["quantization_config"]) == rc


def test_registered_through_the_entry_point():
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS, QUANTIZATION_METHODS

    [ep] = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "qurl"]
    assert ep.load() is register
    register()
    for method in METHODS:
        assert QUANTIZATION_METHODS[method].method == method
        assert CPU_QUANTIZATION_METHODS[method] is QUANTIZATION_METHODS[method]
        assert method in QUANTIZATION_CHOICES


#: the modules of a layer as SGLang 0.5.23's model classes name them (sglang/srt/models/<arch>.py), with the group
#: the plugin quantizes them as (None: never, SGLang builds routers and the shared-expert gate unquantized)
SGLANG_MODULES = {
    "qwen3_moe": {"self_attn.qkv_proj": "attention", "self_attn.o_proj": "attention", "mlp.gate": None,
                  "mlp.experts": "experts"},
    # SGLang's MixtralModel names its layers "layers.{i}", without the "model." of its checkpoint
    "mixtral": {"self_attn.qkv_proj": "attention", "self_attn.o_proj": "attention", "block_sparse_moe.gate": None,
                "block_sparse_moe.experts": "experts"},
    "qwen2_moe": {"self_attn.qkv_proj": "attention", "self_attn.o_proj": "attention", "mlp.gate": None,
                  "mlp.experts": "experts", "mlp.shared_expert.gate_up_proj": "shared_experts",
                  "mlp.shared_expert.down_proj": "shared_experts", "mlp.shared_expert_gate": None},
}
# q_a, kv_a and kv_b: "latent", never quantized (SGLang decodes with W_uk, W_uv rebuilt in bf16 from kv_b_proj)
_MLA = {"self_attn.fused_qkv_a_proj_with_mqa": None, "self_attn.q_b_proj": "attention",
        "self_attn.kv_b_proj": None, "self_attn.o_proj": "attention"}
_GQA = {"self_attn.qkv_proj": "attention", "self_attn.o_proj": "attention"}
_DENSE = {"mlp.gate_up_proj": "mlp", "mlp.down_proj": "mlp"}
_SHARED_MOE = {"mlp.gate": None, "mlp.experts": "experts", "mlp.shared_experts.gate_up_proj": "shared_experts",
               "mlp.shared_experts.down_proj": "shared_experts"}
#: models whose first layer is dense and second MoE (first_k_dense_replace 1): the modules of each layer
SGLANG_LAYER_MODULES = {"deepseek_v3": ({**_MLA, **_DENSE}, {**_MLA, **_SHARED_MOE}),
                        "glm4_moe": ({**_GQA, **_DENSE}, {**_GQA, **_SHARED_MOE})}


@pytest.mark.parametrize("arch", [*SGLANG_MODULES, *SGLANG_LAYER_MODULES])
def test_the_plugin_selects_every_linear_of_the_table_by_its_sglang_module(arch):
    path = tiny_checkpoint(arch)
    selected: dict[str, str] = {}
    for layer, modules in enumerate(SGLANG_LAYER_MODULES.get(arch) or (SGLANG_MODULES[arch],) * 2):
        for module, group in modules.items():
            prefix = f"layers.{layer}.{module}" if arch == "mixtral" else f"model.layers.{layer}.{module}"
            found = sglang_linears(checkpoint_prefix(prefix), num_experts(path))
            assert (found and found[0]) == group, module
            selected.update(dict.fromkeys(found[1] if found else [], group))
    assert selected == hf_linears(path)  # every linear a scope can quantize, under the checkpoint's names


def test_a_qurl_mixtral_is_built_as_sglangs_fused_moe_class():
    """SGLang builds a Mixtral under a method outside its list as QuantMixtralForCausalLM (no routing capture);
    under a qurl method the plugin's hook on `get_model_architecture` builds MixtralForCausalLM. Others keep
    SGLang's choice."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    register()
    built = {}
    for quantization in ("qurl_fp4_rc", "awq", None):
        config = ModelConfig(str(tiny_checkpoint("mixtral")), quantization=quantization)
        chosen = get_model_architecture(config)  # SGLang's own choice: hooks apply only in SGLang's processes
        _, built[quantization] = fused_moe_class(chosen, config) or chosen
        assert config._resolved_model_arch == built[quantization]
    assert built == {"qurl_fp4_rc": "MixtralForCausalLM", "awq": "QuantMixtralForCausalLM",
                     None: "MixtralForCausalLM"}


@pytest.mark.parametrize("scope", ["experts", "all"])
def test_no_qurl_method_lets_sglang_fuse_the_shared_expert(scope):
    """SGLang fuses a shared expert into the routed experts' FusedMoE on CUDA (SM >= 80, EP 1) unless the quant
    config says it cannot; the plugin's tables, the trainer and the symmetry check hold it as its own linears,
    so no qurl method can. DeepSeek-V3's gate asks first of all, before any CUDA condition, so its answer on
    this CPU is the one a GPU gets."""
    from sglang.srt.models.deepseek_common.utils import quant_blocks_shared_experts_fusion
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
    from transformers import AutoConfig

    from qurl_mcore.sglang.quant_config import CONFIGS

    hf = AutoConfig.from_pretrained(tiny_checkpoint("deepseek_v3"))
    for method, cls in CONFIGS.items():
        config = cls(QurlOptions.parse(method, {"scope": scope}))
        assert config.can_fuse_shared_expert() is False and quant_blocks_shared_experts_fusion(config), method
        assert "higher precision" in DeepseekV3ForCausalLM.shared_experts_fusion_disable_reason(hf, config)


def test_a_quantized_engine_turns_sglangs_shared_expert_fusion_off_in_its_server_args():
    """GLM-4.5's fusion gate never asks the quant config: only the server argument turns fusion off. SGLang's
    own ServerArgs, built from the engine's arguments and published, carry it as SGLang's MoE settings read it;
    a BF16 engine keeps SGLang's default."""
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config
    from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
    from sglang.srt.runtime_context import create_context, get_exec, use_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    from qurl_mcore.rollout import EngineConfig
    from qurl_mcore.sglang.quant_config import CONFIGS

    register()
    path = str(tiny_checkpoint("glm4_moe"))
    quantized = EngineConfig(path, "qurl_fp4_rc", device="cpu")
    assert "--disable-shared-experts-fusion" in quantized.server_argv("127.0.0.1", 30000)
    assert "disable_shared_experts_fusion" not in EngineConfig(path, device="cpu").engine_kwargs()
    with use_context(create_context(ServerArgs(**quantized.engine_kwargs()), role="scheduler")):
        assert get_exec().moe.disable_shared_experts_fusion is True
        layout = resolve_shared_experts_config(Glm4MoeForCausalLM, AutoConfig.from_pretrained(path),
                                               CONFIGS["qurl_fp4_rc"]())
    assert layout.fusion_disabled and layout.num_fused_shared_experts == 0


def test_requant_picks_the_quantizer_of_linears_and_experts():
    from qurl_mcore.quant import quantize_weight_compiled
    from qurl_mcore.sglang.linear import QurlLinearMethod
    from qurl_mcore.sglang.moe import QurlFusedMoEMethod

    for requant, quantizer in (("eager", quantize_weight), ("compiled", quantize_weight_compiled)):
        options = QurlOptions.parse("qurl_fp4", {"requant": requant})
        assert QurlLinearMethod(options).quantize_weight is quantizer
        assert QurlFusedMoEMethod(options).quantize_weight is quantizer
        # every layer of an engine computes with the one spec its options resolved
        assert QurlLinearMethod(options).spec is QurlFusedMoEMethod(options).spec is options.recipe.spec


def test_master_detach_attach_keeps_the_parameter_and_its_loader():
    layer = torch.nn.Module()
    param = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
    param.weight_loader = "loader"
    layer.register_parameter("weight", param)
    weights.detach_master(layer, "weight", host=True)
    assert not weights.is_loaded(layer, "weight") and "weight" not in dict(layer.named_parameters())
    weights.attach_master(layer, "weight")
    assert layer.weight is param and layer.weight.weight_loader == "loader"
    weights.attach_master(layer, "weight")  # no-op when attached


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_store_rewrites_in_place(fmt):
    spec = make_spec("rc_none", fmt)
    old = quantize_weight(torch.randn(32, 64), spec)
    ptrs = (old.data.data_ptr(), old.scale.data_ptr())
    new = quantize_weight(torch.randn(32, 64), spec)
    kept = weights.store(old, new)
    assert kept is old and (old.data.data_ptr(), old.scale.data_ptr()) == ptrs
    assert torch.equal(kept.dequantize(), new.dequantize())
    assert weights.store(old, quantize_weight(torch.randn(16, 64), spec)) is not old  # other shape: replaced


@pytest.mark.parametrize("method,fmt", [("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"),
                                        ("qurl_fp4", "mxfp4"), ("qurl_fp4", "hif4")])
def test_stacked_experts_dequantize_as_each_expert_and_refresh_in_place(method, fmt):
    spec = engine_recipe(method, fmt).spec
    experts = [quantize_weight(torch.randn(48, 64) * (e + 1), spec) for e in range(3)]
    stacked, views = weights.stack(experts)
    assert stacked.shape == (3, 48, 64)
    assert torch.equal(stacked.dequantize(), torch.stack([q.dequantize() for q in experts]))
    fresh = quantize_weight(torch.randn(48, 64), spec)
    assert weights.store(views[1], fresh) is views[1]
    assert torch.equal(stacked.dequantize()[1], fresh.dequantize())
    with pytest.raises(ValueError, match="stacking needs groups of one row"):
        weights.stack([quantize_weight(torch.randn(256, 256),
                                       make_spec("rc_none", "int8", weight_granularity=PerBlock((128, 128))))])


def _routed_reference(x, topk_weights, topk_ids, w13, w2, spec):
    """The MoE layer as the trainer's experts run it: expert by expert, each on the tokens routed to it (its
    activation's NVFP4 scale is theirs), each with its own quantized linears."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(len(w13)):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if len(tok):
            gate, up = quantized_linear(x[tok], w13[e], None, spec).chunk(2, dim=-1)
            y = quantized_linear(torch.nn.functional.silu(gate) * up, w2[e], None, spec)
            out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


@pytest.mark.parametrize("method,fmt", [("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"),
                                        ("qurl_fp4_rc", "nvfp4"), ("qurl_fp4_rc", "mxfp4"), ("qurl_fp4_rc", "hif4")])
def test_batched_experts_equal_the_routed_token_by_token_layer(method, fmt):
    """All experts at once (static shapes, no Python loop over experts) against the experts one by one on
    their routed tokens; ids outside [0, E) (padding, other EP ranks) add nothing. Then the same function traced
    whole by torch.compile (fullgraph: no read-back to the host, no data-dependent shape: what a CUDA graph
    capture needs) gives the same output."""
    from qurl_mcore.quant.experts import experts_forward

    spec = engine_recipe(method, fmt).spec
    hidden, inter, experts, tokens = 64, 32, 4, 9
    w13 = [quantize_weight(torch.randn(2 * inter, hidden) / 8, spec) for _ in range(experts)]
    w2 = [quantize_weight(torch.randn(hidden, inter) / 6, spec) for _ in range(experts)]
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)]).int()
    ids[0, 1], ids[3, 0] = -1, experts  # a padded slot, an expert of another EP rank
    p = torch.softmax(torch.randn(tokens, 2), dim=-1)
    (s13, _), (s2, _) = weights.stack(w13), weights.stack(w2)
    got = experts_forward(x, p, ids, s13, s2, spec)
    torch.testing.assert_close(got, _routed_reference(x, p, ids, w13, w2, spec), rtol=1e-5, atol=1e-5)
    compiled = torch.compile(experts_forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, p, ids, s13, s2, spec), got, rtol=0, atol=0)


def test_the_session_shim_stays_off_where_sglang_has_sessions():
    """SGLang 0.5.23 has weight-update sessions of its own: session.py hooks nothing there (on 0.5.15 it does:
    tests/integrations/test_slime.py::test_the_plugin_serves_and_refits_in_slimes_sglang)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from qurl_mcore.sglang import register, session

    register()
    assert session.sglang_has_sessions()
    assert not [t for t in HookRegistry._hooks if t.startswith(session.RUNNER)]


def test_qwen2_moe_shared_gate_on_host_tensors():
    """The CPU stand-in for SGLang's fused Triton gate: final += sigmoid(x·w_gate)·shared, in place, against the
    same sum in float64; a tensor on another device goes to SGLang's kernel, untouched by the stand-in."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from qurl_mcore.sglang import cpu, register

    register()
    assert any(h is cpu._shared_gate_on_host for _, h, _ in HookRegistry._hooks[cpu.SHARED_GATE])
    gen = torch.Generator().manual_seed(0)
    x, shared, final = (torch.randn(5, 16, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(16, generator=gen, dtype=torch.bfloat16)
    want = final.double() + torch.sigmoid(x.double() @ w.double())[:, None] * shared.double()
    out = final.clone()
    assert cpu._shared_gate_on_host(None, x, w, shared, out) is None
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=2 ** -7, atol=0)  # one bf16 ulp: fp32, rounded once
    calls = []
    meta = [t.to("meta") for t in (x, w, shared, final)]
    cpu._shared_gate_on_host(lambda *args: calls.append(args), *meta)
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], meta))
