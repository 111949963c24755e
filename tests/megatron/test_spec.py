import pytest
import torch

from qurl_mcore.megatron.layers import QuantColumnParallelLinear, QuantRowParallelLinear
from qurl_mcore.megatron.gpt import build_gpt, gpt_config
from qurl_mcore.megatron.spec import gpt_spec, linear_group
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.quant import PerTensor
from qurl_mcore.recipe import check_runnable, resolve, te_fp8_available
from tests.conftest import requires_cuda

from .helpers import random_ids


def _forward_backward(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, None)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_bf16_precision_is_bitwise_the_stock_local_spec(arch, reseed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    path = tiny_checkpoint(arch)
    config = gpt_config(path)
    stock_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True,
                                          normalization="RMSNorm")
    kw = dict(config=config, vocab_size=49152, max_sequence_length=64, position_embedding_type="rope")
    reseed()
    stock = GPTModel(transformer_layer_spec=stock_spec, **kw)
    reseed()
    ours = GPTModel(transformer_layer_spec=gpt_spec(config, resolve("bf16")), **kw)
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ids = random_ids(2, 16)
    out_stock, grads_stock = _forward_backward(stock, ids)
    out_ours, grads_ours = _forward_backward(ours, ids)
    assert torch.equal(out_stock, out_ours)
    assert all(torch.equal(grads_stock[n], grads_ours[n]) for n in grads_stock)


def _quantized(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, (QuantColumnParallelLinear, QuantRowParallelLinear))}


def test_scope_experts_quantizes_only_routed_experts(megatron_ws1):
    from megatron.core.transformer.moe.router import TopKRouter

    recipe = resolve("fp4_rc", "experts")
    model = build_gpt(tiny_checkpoint("qwen3_moe"), recipe=recipe)
    names = _quantized(model)
    assert names and all(".mlp.experts.local_experts." in n for n in names)
    assert len(names) == 2 * 2 * 4  # layers x (fc1, fc2) x experts
    assert all(m.quant.mode == "rc_both" and m.quant.fmt == "nvfp4"
               for m in model.modules() if isinstance(m, QuantColumnParallelLinear))
    # resolved once: every quantized linear holds the recipe's own spec
    assert all(m.quant is recipe.train for m in model.modules() if hasattr(m, "quant"))
    assert sum(isinstance(m, TopKRouter) for m in model.modules()) == 2
    assert type(model.output_layer).__name__ == "ColumnParallelLinear"


def test_scope_all_adds_attention(megatron_ws1):
    names = _quantized(build_gpt(tiny_checkpoint("qwen3_moe"), recipe=resolve("fp4", "all", "mxfp4")))
    assert {n.split(".")[-1] for n in names} == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert "output_layer" not in names and not any("router" in n for n in names)


def test_mla_keeps_its_latent_projections_full_precision_on_both_sides(megatron_ws1):
    """SGLang decodes DeepSeek's MLA with W_uk, W_uv rebuilt in bf16 from the full-precision kv_b_proj on every
    load and push: a quantized kv_b_proj would reach prefill only. Scope "all" quantizes q_b_proj and o_proj on
    both sides, never kv_b_proj (Megatron's linear_kv_up_proj) or the down projections."""
    from qurl_mcore.precision import quantized_linears

    path = tiny_checkpoint("deepseek_v3")
    names = {n.split(".", 3)[-1] for n in _quantized(build_gpt(path, recipe=resolve("fp4", "all")))
             if ".self_attention." in n}
    assert names == {"self_attention.linear_q_up_proj", "self_attention.linear_proj"}
    for side in ("train", "rollout"):
        attention = {n.split(".", 3)[-1] for n in quantized_linears(path, "fp4", "all", side) if ".self_attn." in n}
        assert attention == {"self_attn.q_b_proj", "self_attn.o_proj"}


def test_dense_experts_scope_is_the_mlp(megatron_ws1):
    names = _quantized(build_gpt(tiny_checkpoint("qwen3"), recipe=resolve("fp4_rc_train")))  # default scope: experts
    assert {n.split(".", 3)[-1] for n in names} == {"mlp.linear_fc1", "mlp.linear_fc2"}


def test_qurl_precisions_train_in_full_precision(megatron_ws1):
    for precision in ("bf16", "int8", "fp8"):
        assert not _quantized(build_gpt(tiny_checkpoint("qwen3_moe"), recipe=resolve(precision, "all")))


def test_trainer_specs_come_from_the_precision_table():
    assert resolve("fp4_rc").train.mode == "rc_both"
    assert resolve("fp4_rc_rollout", fmt="mxfp4").train.mode == "rc_none"
    assert resolve("fp4_rc_train", fmt="mxfp4").train.mode == "rc_both"
    fp8 = resolve("fp8_e2e").train
    assert (fp8.fmt, fp8.weight_granularity, fp8.act_granularity, fp8.grad_granularity) == \
        ("fp8_e4m3", PerTensor(), PerTensor(), PerTensor())
    assert not resolve("int8").train.quantized
    with pytest.raises(ValueError, match="unknown precision"):
        resolve("int4")
    with pytest.raises(ValueError, match="runs in"):
        resolve("fp4", fmt="int8")


def test_linear_groups_of_megatron_names():
    layer = "decoder.layers.3."
    assert linear_group(layer + "self_attention.linear_qkv.weight") == "attention"
    assert linear_group(layer + "mlp.linear_fc2.weight") == "mlp"
    assert linear_group(layer + "mlp.experts.local_experts.7.linear_fc1.weight") == "experts"
    assert linear_group(layer + "mlp.shared_experts.linear_fc1.weight") == "shared_experts"
    for never in ("mlp.router.weight", "input_layernorm.weight", "self_attention.linear_qkv.bias"):
        assert linear_group(layer + never) is None
    assert linear_group("output_layer.weight") is None


def test_unknown_scope_is_refused(megatron_ws1):
    with pytest.raises(ValueError, match="scope"):
        resolve("fp4", scope="attention")


def test_the_builders_take_a_recipe_not_a_precision_name(megatron_ws1):
    """A precision is resolved once, where the model is built; a bare name would be resolved again."""
    config = gpt_config(tiny_checkpoint("qwen3"))
    with pytest.raises(TypeError, match="expected a Recipe, got 'fp4'"):
        gpt_spec(config, "fp4")
    with pytest.raises(TypeError, match="expected a Recipe"):
        build_gpt(tiny_checkpoint("qwen3"), recipe="fp4")


def test_transformer_engine_needs_megatrons_fp8_settings(megatron_ws1):
    """A recipe that trains per tensor where TE is installed runs TE's FP8 (on this CPU: said so by hand);
    a config without Megatron's fp8 settings would not enter fp8_autocast and is refused."""
    recipe = resolve("fp8_e2e", "all", te_available=True)
    assert recipe.te and not resolve("fp8_e2e", "all", te_available=False).te
    assert not resolve("fp4", te_available=True).te  # per-block FP4 runs the qurl_mcore.quant emulation
    with pytest.raises(ValueError, match="precision 'fp8_e2e' on Transformer Engine needs config.fp8='e4m3'"):
        gpt_spec(gpt_config(tiny_checkpoint("qwen3")), recipe)


@pytest.mark.skipif(te_fp8_available(), reason="this process can run Transformer Engine")
def test_a_rank_refuses_a_transformer_engine_recipe_it_cannot_run():
    """The driver decides TE for the whole run (its trainers' devices, the software every node shares); a rank
    that cannot run TE (here: no CUDA device) refuses the recipe it was handed, naming the fix, and one that
    can run what it received is let through."""
    with pytest.raises(RuntimeError, match="precision 'fp8_e2e' trains on Transformer Engine.*gpu-te.txt"):
        check_runnable(resolve("fp8_e2e", "all", te_available=True))
    check_runnable(resolve("fp8_e2e", "all", te_available=False))  # the emulation runs anywhere


def test_rc_is_closer_to_bf16_than_plain_fp4(megatron_ws1):
    """End to end, RC's forward error is below plain FP4's (RC corrects the activations; the weight error,
    quantized once in both, remains) and FP8's is below both."""
    from qurl_mcore.megatron.convert import load_hf_weights

    path = tiny_checkpoint("qwen3_moe")
    ids = random_ids(2, 16)
    pos = torch.arange(16).expand_as(ids)
    out = {}
    for precision in ("bf16", "fp4", "fp4_rc", "fp8_e2e"):
        model = build_gpt(path, recipe=resolve(precision, "all"))
        load_hf_weights(model, path)
        with torch.no_grad():
            out[precision] = model(ids, pos, None)
    err = {r: ((out[r] - out["bf16"]).norm() / out["bf16"].norm()).item() for r in ("fp4", "fp4_rc", "fp8_e2e")}
    assert 0 < err["fp4_rc"] < 0.85 * err["fp4"], err
    assert 0 < err["fp8_e2e"] < err["fp4_rc"], err


def test_fp4_rc_model_learns_a_toy_task(reseed):
    """Next token = token + 1 (mod 32) on a tiny MoE whose experts run fp4_rc (quantized forward and
    backward): the loss falls, and the quantized experts receive finite gradients and move."""
    from megatron.core.models.gpt import GPTModel

    reseed(7)
    config = gpt_config(tiny_checkpoint("qwen3_moe"), num_layers=1, hidden_size=64, ffn_hidden_size=128,
                        moe_ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16)
    model = GPTModel(config=config, transformer_layer_spec=gpt_spec(config, resolve("fp4_rc", "experts")),
                     vocab_size=32, max_sequence_length=32, position_embedding_type="rope")
    expert = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1
    assert isinstance(expert, QuantColumnParallelLinear)
    start_weight = expert.weight.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(15):
        ids = (torch.randint(0, 32, (8, 1), generator=gen) + torch.arange(16)) % 32
        loss = model(ids, torch.arange(16).expand_as(ids), None, labels=(ids + 1) % 32).mean()
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(expert.weight.grad).all() and expert.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses
    assert not torch.equal(expert.weight.detach(), start_weight)


@pytest.mark.gpu
@requires_cuda
def test_fp8_training_uses_transformer_engine_on_gpu(megatron_ws1):
    pytest.importorskip("transformer_engine", reason="FP8 training on GPU runs Transformer Engine modules")
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match="fp8"):
        gpt_spec(gpt_config(path), resolve("fp8_e2e", "all"))  # a config without Megatron's fp8 settings
    model = build_gpt(path, recipe=resolve("fp8_e2e", "all"), use_cpu_initialization=False).cuda()
    assert any(isinstance(m, TEColumnParallelLinear) for m in model.modules())
    ids = random_ids(2, 32).cuda()
    logits = model(ids, torch.arange(32, device="cuda").expand_as(ids), None)
    assert torch.isfinite(logits).all()


def test_sdpa_attention_equals_megatrons_local_attention(megatron_ws1):
    """The GPU's core attention (torch SDPA) computes Megatron's local attention, run here on the CPU with
    grouped-query heads and a padding mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from qurl_mcore.megatron.attention import SDPAttention
    from qurl_mcore.megatron.logprobs import attention_mask_for, segments

    config = gpt_config(tiny_checkpoint("qwen3"))  # 4 heads in 2 groups of head dim 32
    s, b = 12, 3
    q = torch.randn(s, b, 4, 32)
    k, v = torch.randn(s, b, 2, 32), torch.randn(s, b, 2, 32)
    lengths = torch.tensor([12, 7, 3])
    mask = attention_mask_for(segments(torch.arange(s)[None] < lengths[:, None], None, (b, s)))
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    want = DotProductAttention(**args)(q, k, v, mask)
    got = SDPAttention(**args)(q, k, v, mask)
    # padding query positions attend to themselves (no fully masked row, logprobs.attention_mask_for): all agree
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_experts_see_token_counts_padded_to_16_whatever_the_routing(megatron_ws1):
    """`fp8_e2e` on an MoE: each expert's fc1/fc2 gets the tokens the router gave it, any number, and TE's FP8
    GEMMs take multiples of 16 rows. Megatron's SequentialMLP (the experts `gpt_spec` builds) pads each expert's
    tokens to that multiple when the config has `fp8` (which `build_gpt` sets for a TE recipe) and drops the
    padding's rows after: every expert linear sees a multiple of 16 rows, and the output is the unpadded one."""
    model = build_gpt(tiny_checkpoint("qwen3_moe"), experts="sequential")  # the module TE recipes build
    experts = model.decoder.layers[0].mlp.experts
    rows: list[int] = []
    for expert in experts.local_experts:
        for linear in (expert.linear_fc1, expert.linear_fc2):
            linear.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    counts = torch.tensor([3, 17, 0, 9])  # any numbers: what a router gives
    x = torch.randn(int(counts.sum()), model.config.hidden_size)
    probs = torch.rand(int(counts.sum()))
    with torch.no_grad():
        plain, _ = experts(x, counts, probs)
        assert sorted(rows) == [0, 0, 3, 3, 9, 9, 17, 17]  # the test sees the counts the experts get
        rows.clear()
        saved = experts.config.fp8, experts.config.fp8_recipe
        experts.config.fp8, experts.config.fp8_recipe = "e4m3", "tensorwise"  # what build_gpt sets for TE
        try:
            padded, _ = experts(x, counts, probs)
        finally:
            experts.config.fp8, experts.config.fp8_recipe = saved
    assert rows and all(r % 16 == 0 for r in rows), rows
    torch.testing.assert_close(padded, plain)
