"""The slime adapter (qurl_mcore.integrations.slime) against slime's call sites, read at THUDM/slime commit
624b824a898ab0ec1fcb4d373004c7f3852bf515 (slime is not a package on the registry, so these tests build the
arguments its call sites build, with the shapes and dtypes cited, and check them against our own losses and
models). File:line references are to that commit."""
from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from qurl_mcore.integrations import slime as S
from qurl_mcore.recipe import resolve
from qurl_mcore.rl.losses import policy_loss

PROMPTS = (4, 6, 2, 3)
RESPONSES = (5, 3, 7, 4)
VOCAB = 11


def _args(**over) -> Namespace:
    """The slime arguments the adapter reads, at slime's defaults (slime/utils/arguments.py:899-1076) with the
    clip-higher of its GRPO scripts (scripts/run-qwen3-4B.sh: --eps-clip 0.2 --eps-clip-high 0.28)."""
    args = dict(
        eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, tis_clip=2.0, tis_clip_low=0, use_tis=False,
        custom_tis_function_path=None, use_rollout_logprobs=False, use_opsm=False,
        custom_pg_loss_reducer_function_path=None, advantage_estimator="grpo", use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="low_var_kl", use_unbiased_kl=False, entropy_coef=0.0,
        rollout_temperature=1.0, rollout_top_p=1.0, calculate_per_token_loss=False,
    )
    args.update(over)
    return Namespace(**args)


def _loss_masks() -> list[torch.Tensor]:
    """int32 [R_i] per sample (actor.py:259-263); the second sample has a masked middle (e.g. a tool reply)."""
    masks = [torch.ones(r, dtype=torch.int32) for r in RESPONSES]
    masks[1][1] = 0
    masks[2][4:6] = 0
    return masks


def _sum_of_sample_mean(masks, denoms=None, per_token=False):
    """slime's reducer without context parallelism, restated from backends/megatron_utils/cp_utils.py:67-89, 124:
    Σ_i Σ_t x·m / max(denom_i, 1) with denom_i = Σ_t m by default, or Σ_i Σ_t x·m per token."""
    denoms = [m.sum() for m in masks] if denoms is None else denoms

    def reduce(x):
        parts = x.split(list(RESPONSES), dim=0)
        if per_token:
            return sum((p * m).sum() for p, m in zip(parts, masks))
        return sum((p * m).sum() / torch.clamp_min(d, 1) for p, m, d in zip(parts, masks, denoms))

    return reduce


def _samples(seed=0):
    """Per-sample float32 [R_i] tensors as the batch carries them (loss.py:964; actor.py:284-298)."""
    g = torch.Generator().manual_seed(seed)
    prox = [-torch.rand(r, generator=g) * 3 for r in RESPONSES]
    behav = [p + 0.3 * torch.randn(r, generator=g) for p, r in zip(prox, RESPONSES)]  # the quantized rollout
    current = [(p + 0.25 * torch.randn(r, generator=g)).requires_grad_() for p, r in zip(prox, RESPONSES)]
    adv = [torch.full((r,), float(a)) for r, a in zip(RESPONSES, torch.randn(len(RESPONSES), generator=g))]
    return current, {"log_probs": prox, "rollout_log_probs": behav, "advantages": adv,
                     "ref_log_probs": [p - 0.1 for p in prox], "loss_masks": _loss_masks()}


def _padded(xs):
    out = torch.zeros(len(xs), max(RESPONSES))
    for i, x in enumerate(xs):
        out[i, : len(x)] = x
    return out


def _reference(current, batch, agg, **kw):
    """policy_loss(method="acr") on the padded [B, L] layout of our own loop."""
    pad = lambda key: _padded(batch[key])  # noqa: E731
    logprobs = torch.zeros(len(current), max(RESPONSES)).index_put(
        (torch.cat([torch.full((r,), i) for i, r in enumerate(RESPONSES)]),
         torch.cat([torch.arange(r) for r in RESPONSES])), torch.cat(current))
    return policy_loss(logprobs, pad("log_probs"), pad("rollout_log_probs"), pad("advantages"),
                       _padded(batch["loss_masks"]).bool(), method="acr", eps_low=0.2, eps_high=0.28,
                       tis_cap=2.0, agg=agg, **kw)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


# ---- the loss --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["sample_mean", "per_token", "rollout_mean"])
def test_acr_loss_is_our_acr_under_every_slime_reduction(reduction):
    """The three reducers slime's loss_function builds (loss.py:1319-1325) weigh tokens differently; each equals
    our policy_loss under the aggregation with the same weights: per-sample means summed over the samples
    (seq_mean_token_mean × samples), a token sum (--calculate-per-token-loss: token_mean × tokens), and a
    per-rollout token mean (rollout_mask_sums, here one rollout group spanning the micro-batch: token_mean)."""
    current, batch = _samples()
    masks = batch["loss_masks"]
    tokens = int(sum(m.sum() for m in masks))
    if reduction == "sample_mean":
        reduce, agg, scale = _sum_of_sample_mean(masks), "seq_mean_token_mean", len(masks)
    elif reduction == "per_token":
        reduce, agg, scale = _sum_of_sample_mean(masks, per_token=True), "token_mean", tokens
    else:
        reduce, agg, scale = _sum_of_sample_mean(masks, denoms=[torch.tensor(float(tokens))] * 4), "token_mean", 1
    loss, metrics = S.acr_loss_from_logprobs(_args(), batch, current, reduce, logits=torch.zeros(1))
    expected, stats = _reference(current, batch, agg)
    expected = expected * scale
    torch.testing.assert_close(loss, expected)
    for got, want in zip(_grads(loss, current), _grads(expected, current)):
        torch.testing.assert_close(got, want)
    assert metrics["loss/total"].item() == pytest.approx(loss.item())
    mass = {"sample_mean": len(masks), "per_token": tokens, "rollout_mean": 1}[reduction]
    for key in S.TOKEN_MEAN_METRICS:  # token means over the micro-batch, times the reducer's total weight
        assert metrics[key].item() == pytest.approx(stats[key] * mass, rel=1e-6, abs=1e-7)
    assert 0 < stats["clip_frac/high"] + stats["clip_frac/low"] < 1  # the clip is exercised, not vacuous


def test_kl_and_entropy_terms_follow_slime_flags():
    """--use-kl-loss --kl-loss-coef --kl-loss-type k3 and --entropy-coef (loss.py:1114-1130) add the same
    terms as our policy_loss's kl_coef/entropy_coef."""
    current, batch = _samples(seed=1)
    entropy = [torch.rand(r).requires_grad_() for r in RESPONSES]
    args = _args(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01)
    loss, metrics = S.acr_loss_from_logprobs(args, batch, current, _sum_of_sample_mean(batch["loss_masks"]),
                                             logits=torch.zeros(1), entropy=entropy)
    expected, _ = _reference(current, batch, "seq_mean_token_mean", ref_logprobs=_padded(batch["ref_log_probs"]),
                             kl_coef=0.1, kl_estimator="k3", entropy=_padded(entropy), entropy_coef=0.01)
    expected = expected * len(RESPONSES)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(_grads(loss, current + entropy), _grads(expected, current + entropy)):
        torch.testing.assert_close(got, want)
    assert set(metrics) == {"loss/total", "loss/policy", "kl_ref", "entropy", *S.TOKEN_MEAN_METRICS}


@pytest.fixture
def slime_loss_helpers(monkeypatch):
    """slime's log-prob helper, restated without tensor or context parallelism from loss.py:513-604 (shifted
    targets: _build_shifted_tokens 273-323; response rows start-1..end-1: _extract_per_sample 500-508), with its
    keyword-only signature, importable where the adapter imports it; also megatron_to_hf's dispatcher
    (megatron_to_hf/__init__.py:41), recording the names it is given."""
    loss = types.ModuleType("slime.backends.megatron_utils.loss")

    def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                                  top_p_token_offsets=None):
        assert logits.dtype == torch.float32 and logits.dim() == 3 and logits.size(0) == 1
        logp = torch.log_softmax(logits.squeeze(0) / args.rollout_temperature, -1)
        out, ent, end = [], [], 0
        for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths):
            end += total
            rows = logp[end - resp - 1: end - 1]
            out.append(rows.gather(-1, tokens[-resp:, None]).squeeze(-1))
            ent.append(-(rows.exp() * rows).sum(-1))
        return torch.empty(0), {"log_probs": out, **({"entropy": ent} if with_entropy else {})}

    loss.get_log_probs_and_entropy = get_log_probs_and_entropy
    loss.get_rollout_top_p_logprob_kwargs = lambda args, batch: {}  # rollout_top_p == 1.0 (loss.py:83-86)
    converters = types.ModuleType("slime.backends.megatron_utils.megatron_to_hf")
    converters.seen = []
    converters._convert_to_hf_core = lambda args, model_name, name, param: converters.seen.append(name) or []
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, loss.__name__, loss)
    monkeypatch.setitem(sys.modules, converters.__name__, converters)
    sys.modules["slime.backends.megatron_utils"].megatron_to_hf = converters
    return converters


@pytest.mark.parametrize("recompute", [False, True])
def test_acr_loss_from_packed_logits(slime_loss_helpers, recompute):
    """acr_loss(args, batch, logits, sum_of_sample_mean) as loss_function calls it (loss.py:1334-1342), on
    logits [1, T, V] float32 of the packed micro-batch (T padded: data.py:83-87), directly and under
    --recompute-loss-function (a non-reentrant checkpoint, loss.py:1340). Loss and gradient w.r.t. the logits
    equal our policy_loss on log-probs taken from the same logits independently."""
    _, batch = _samples(seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (p + r,), generator=g) for p, r in zip(PROMPTS, RESPONSES)]
    total = sum(PROMPTS) + sum(RESPONSES)
    logits = torch.randn(1, total + 6, VOCAB, generator=g).requires_grad_()
    batch.update(unconcat_tokens=tokens, total_lengths=[p + r for p, r in zip(PROMPTS, RESPONSES)],
                 response_lengths=list(RESPONSES))
    args, reduce = _args(rollout_temperature=0.7), _sum_of_sample_mean(batch["loss_masks"])
    if recompute:
        loss, _ = checkpoint(S.acr_loss, args, batch, logits, reduce, use_reentrant=False)
    else:
        loss, _ = S.acr_loss(args, batch, logits, reduce)
    logp = torch.log_softmax(logits[0] / 0.7, -1)
    current, end = [], 0
    for p, r, t in zip(PROMPTS, RESPONSES, tokens):  # response token j of a sample is predicted at row j - 1
        end += p + r
        current.append(logp[end - r - 1 + torch.arange(r), t[-r:]])
    expected = _reference(current, batch, "seq_mean_token_mean")[0] * len(RESPONSES)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(_grads(loss, logits)[0], _grads(expected, logits)[0])


def test_a_micro_batch_without_response_tokens_gives_a_zero_loss_with_the_same_metrics():
    """A context-parallel rank may hold only prompt tokens of a micro-batch; slime then still needs a loss on the
    graph (loss.py:1133) and every rank must report the same metric keys (they are all-reduced by position:
    observability/train_metric_utils.py:45-50)."""
    current, batch = _samples()
    masks = [torch.zeros(r, dtype=torch.int32) for r in RESPONSES]
    logits = torch.randn(1, 3, VOCAB, requires_grad=True)
    loss, metrics = S.acr_loss_from_logprobs(_args(), batch, current, _sum_of_sample_mean(masks), logits=logits)
    _, full = S.acr_loss_from_logprobs(_args(), batch, current, _sum_of_sample_mean(batch["loss_masks"]),
                                       logits=logits)
    assert loss.item() == 0 and list(metrics) == list(full)
    assert torch.count_nonzero(_grads(loss, logits)[0]) == 0


@pytest.mark.parametrize("over, fragment", [
    ({"use_rollout_logprobs": True}, "drop --use-rollout-logprobs"),
    ({"use_tis": True}, "drop --use-tis"),
    ({"tis_clip_low": 0.5}, "drop --tis-clip-low"),
    ({"eps_clip_c": 3.0}, "drop --eps-clip-c"),
    ({"advantage_estimator": "gspo"}, "use grpo"),
    ({"use_kl_loss": True, "kl_loss_coef": 0.01}, "use one of ['k1', 'k3']"),
])
def test_settings_acr_would_ignore_are_refused(over, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        S.check_loss_args(_args(**over))
    S.check_loss_args(_args(use_kl_loss=True, kl_loss_coef=0.0))  # slime's scripts: KL on, coefficient 0


def test_missing_rollout_logprobs_are_named():
    current, batch = _samples()
    batch.pop("rollout_log_probs")
    with pytest.raises(ValueError, match="rollout_log_probs"):
        S.acr_loss_from_logprobs(_args(), batch, current, _sum_of_sample_mean(batch["loss_masks"]),
                                 logits=torch.zeros(1))


# ---- the model provider ------------------------------------------------------------------------------------

def _model_args(path, precision, **over) -> Namespace:
    """The arguments slime's default provider hands GPTModel (model_provider.py:200-214), for checkpoint `path`,
    plus our YAML keys."""
    from qurl_mcore.megatron.gpt import load_hf_config, rope_theta
    from qurl_mcore.precision import get_precision

    hf = load_hf_config(path)
    args = dict(
        padded_vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
        fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=rope_theta(hf), use_rope_scaling=False,
        mtp_num_layers=None, finetune=True, qurl_precision=precision,
        sglang_quantization=get_precision(precision).rollout)
    return Namespace(**{**args, **over})


def _build(path, precision, **config_over):
    from qurl_mcore.megatron.convert import load_hf_weights
    from qurl_mcore.megatron.gpt import gpt_config

    model = S.gpt_model(_model_args(path, precision), gpt_config(path, **config_over))
    load_hf_weights(model, path)
    return model


def test_provider_builds_our_trainer_model(megatron_ws1):
    """fp4_rc on a Qwen3-MoE: the experts are our quantized linears with RC in forward and backward, and the model
    computes what our own loop's build_gpt model computes, logits and gradients, on the CPU."""
    from qurl_mcore.megatron.convert import load_hf_weights
    from qurl_mcore.megatron.layers import QuantColumnParallelLinear, QuantRowParallelLinear
    from qurl_mcore.megatron.gpt import build_gpt
    from qurl_mcore.models.tiny import tiny_checkpoint

    path = tiny_checkpoint("qwen3_moe")
    model = _build(path, "fp4_rc")
    ours = build_gpt(path, recipe=resolve("fp4_rc"))
    load_hf_weights(ours, path)
    quant = {n: m.quant for n, m in model.named_modules()
             if isinstance(m, (QuantColumnParallelLinear, QuantRowParallelLinear))}
    assert quant and all(".experts." in n for n in quant)
    assert all(q.rc_forward and q.rc_backward and q.fmt == "nvfp4" for q in quant.values())
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand_as(ids)
    out, ref = model(ids, pos, None), ours(ids, pos, None)
    torch.testing.assert_close(out, ref)
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    got = torch.autograd.grad(out.square().mean(), dict(model.named_parameters())[name])[0]
    want = torch.autograd.grad(ref.square().mean(), dict(ours.named_parameters())[name])[0]
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0


#: the per-layer names slime's converters know (megatron_to_hf/qwen2.py:22-67, qwen3moe.py:26-43, 106)
_CONVERTER_NAMES = (
    r"self_attention\.linear_(proj|qkv)\.weight", r"self_attention\.linear_qkv\.bias",
    r"self_attention\.linear_qkv\.layer_norm_weight", r"self_attention\.[qk]_layernorm\.weight",
    r"mlp\.linear_fc[12]\.weight", r"mlp\.linear_fc1\.layer_norm_weight", r"mlp\.experts\.linear_fc[12]\.weight\d+",
    r"mlp\.router\.weight",
)


@pytest.mark.parametrize("arch, precision", [("llama", "int8"), ("qwen3_moe", "fp4_rc")])
def test_every_parameter_reaches_slime_converters(arch, precision, megatron_ws1, slime_loss_helpers):
    """slime pushes weights to SGLang by converting Megatron names (update_weight/common.py:198-231 then
    megatron_to_hf); `te_name` turns every name gpt_spec gives into one of the converters' names, and the
    provider's routing of the dispatcher through it is idempotent."""
    import re

    from qurl_mcore.models.tiny import tiny_checkpoint

    model = _build(tiny_checkpoint(arch), precision)
    top = {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"}
    layer = re.compile(r"decoder\.layers\.\d+\.(" + "|".join(_CONVERTER_NAMES) + ")")
    for name, _ in model.named_parameters():
        te = S.te_name(name)
        assert te in top or layer.fullmatch(te), (name, te)
    S._teach_converters()
    wrapped = slime_loss_helpers._convert_to_hf_core
    S._teach_converters()
    assert slime_loss_helpers._convert_to_hf_core is wrapped
    slime_loss_helpers._convert_to_hf_core(None, "qwen3moeconfig", "module.module.decoder.layers.0.input_layernorm"
                                           ".weight", None)
    assert slime_loss_helpers.seen == ["module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]


def test_trainer_and_engines_must_agree():
    from qurl_mcore.models.tiny import tiny_checkpoint

    args = _model_args(tiny_checkpoint("llama"), "fp4_rc")
    assert S.precision_of(args)[1:] == ("experts", "nvfp4")
    with pytest.raises(ValueError, match="sglang_quantization: qurl_fp4_rc"):
        S.precision_of(Namespace(**{**vars(args), "sglang_quantization": "qurl_int8"}))
    with pytest.raises(ValueError, match="'mxfp4' but the engines 'experts' in 'nvfp4'"):
        S.precision_of(Namespace(**{**vars(args), "qurl_fp4_format": "mxfp4"}))
    override = '{"quantization_config": {"quant_method": "qurl_fp4_rc", "fmt": "mxfp4"}}'
    S.precision_of(Namespace(**{**vars(args), "qurl_fp4_format": "mxfp4", "sglang_json_model_override_args": override}))
    with pytest.raises(ValueError, match="qurl_precision is not set"):
        S.precision_of(Namespace(sglang_quantization=None))


# ---- UAQ ---------------------------------------------------------------------------------------------------

def test_uaq_hook_scales_once_and_the_optimizer_keeps_it(megatron_ws1):
    """slime calls the hook before every train step with the DDP chunks and Megatron's optimizer
    (model.py:557-561). The hook's rescaling equals apply_uaq's, survives a step of Megatron's optimizer, happens
    once, and asks the optimizer to refresh its main weights (with bf16 parameters those are separate fp32
    copies; Megatron builds that optimizer for CUDA tensors only, so here the parameters are fp32); a resumed
    run (args.finetune False: arguments.py:1829-1832) and the critic (model.py:1000) are left alone."""
    from qurl_mcore.megatron import apply_uaq
    from qurl_mcore.megatron.training import build_training
    from qurl_mcore.models.tiny import tiny_checkpoint

    path = tiny_checkpoint("llama")
    stack = build_training(_build(path, "int8", calculate_per_token_loss=True), lr=1e-3)
    expected = _build(path, "int8")
    apply_uaq(expected, 1.5)
    args = _model_args(path, "int8", qurl_uaq_scale=1.5)
    reloads = []
    reload = stack.optimizer.reload_model_params
    stack.optimizer.reload_model_params = lambda *a, **k: reloads.append(1) or reload(*a, **k)

    def params(module):
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    before = params(stack.model)
    S.uaq_hook(args, 0, 0, [stack.ddp], stack.optimizer, None)
    stack.ddp.zero_grad_buffer()
    stack.optimizer.zero_grad()
    stack.optimizer.step()  # zero gradients: Adam moves nothing, but writes its weights back
    S.uaq_hook(args, 0, 1, [stack.ddp], stack.optimizer, None)
    after, want = params(stack.model), params(expected)
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert changed and all(torch.equal(after[n], want[n]) for n in after) and reloads == [1]
    assert any("input_layernorm" in n for n in changed) and any("linear_qkv" in n for n in changed)

    for over, role in (({"finetune": False}, "actor"), ({}, "critic")):
        other = build_training(_build(path, "int8", calculate_per_token_loss=True), lr=1e-3)
        other.ddp.role = role
        first = params(other.model)
        S.uaq_hook(_model_args(path, "int8", **over), 0, 0, [other.ddp], other.optimizer, None)
        assert all(torch.equal(first[n], p) for n, p in params(other.model).items())


def test_uaq_hook_refuses_what_it_cannot_rescale():
    """slime's default (Transformer Engine) layers fuse the norms into linear_qkv/linear_fc1, names apply_uaq
    does not rescale; and UAQ belongs to the precisions with a UAQ scope, each on its scope."""
    layer = torch.nn.Module()
    layer.linear_qkv = torch.nn.Module()
    layer.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="--custom-model-provider-path qurl_mcore.integrations.slime.model_provider"):
        S.uaq_hook(Namespace(qurl_precision="int8", sglang_quantization="qurl_int8", finetune=True), 0, 0, [layer],
                   None, None)
    with pytest.raises(ValueError, match="not precision 'fp4_rc_train'.*drop --custom-megatron-before-train"):
        S.uaq_hook(Namespace(qurl_precision="fp4_rc_train", sglang_quantization="qurl_fp4", finetune=True), 0, 0,
                   [layer], None, None)
    with pytest.raises(ValueError, match="set scope=experts"):
        S.uaq_hook(Namespace(qurl_precision="fp4_rc", qurl_scope="all", sglang_quantization="qurl_fp4_rc",
                             sglang_json_model_override_args='{"quantization_config": {"quant_method": '
                             '"qurl_fp4_rc", "scope": "all"}}', finetune=True), 0, 0, [layer], None, None)



def test_a_uaq_scaled_save_hf_export_comes_out_unscaled(megatron_ws1, tmp_path, capsys):
    """slime's `--save-hf` (actor.py:589-590) writes the actor as it trains, UAQ-scaled by `uaq_hook`.
    `qurl export DIR OUT --uaq-scale s` gives back the source checkpoint's weights (to fp32 rounding), which
    transformers loads with the source's logits; the two misuses of the flag are refused by name."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from qurl_mcore.cli import main
    from qurl_mcore.megatron import export_hf_weights
    from qurl_mcore.megatron.convert import read_hf_state
    from qurl_mcore.megatron.training import build_training
    from qurl_mcore.models.tiny import tiny_checkpoint

    path = tiny_checkpoint("llama")
    stack = build_training(_build(path, "int8", calculate_per_token_loss=True), lr=1e-3)
    S.uaq_hook(_model_args(path, "int8", qurl_uaq_scale=1.5), 0, 0, [stack.ddp], stack.optimizer, None)
    saved = tmp_path / "save_hf"  # what slime's saver writes: its converters' HF names, the weights as they are
    saved.mkdir()
    save_file({n: t.contiguous() for bucket in export_hf_weights(stack.model, path, dtype=torch.float32)
               for n, t in bucket}, str(saved / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (saved / f).write_bytes((path / f).read_bytes())
    source, scaled = read_hf_state(path), read_hf_state(saved)
    norm = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(scaled[norm], 1.5 * source[norm].float())

    assert main(["export", str(saved), str(tmp_path / "hf"), "--uaq-scale", "1.5"]) == 0
    unscaled = read_hf_state(tmp_path / "hf")
    assert unscaled.keys() == source.keys() and all(t.dtype == torch.float32 for t in unscaled.values())
    for name, tensor in source.items():
        torch.testing.assert_close(unscaled[name], tensor.float(), rtol=1e-6, atol=1e-7)
    ids = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and not (tmp_path / "hf.partial").exists()

    capsys.readouterr()
    assert main(["export", str(saved), str(tmp_path / "again")]) == 2
    assert "pass --uaq-scale S" in capsys.readouterr().out and not (tmp_path / "again").exists()
    assert main(["export", str(tmp_path / "no_checkpoint"), str(tmp_path / "again"), "--uaq-scale", "1.5"]) == 2
    assert "--uaq-scale is for an HF checkpoint directory" in capsys.readouterr().out

# ---- the rollout side --------------------------------------------------------------------------------------

def test_engine_args_reach_sglang_and_the_plugin_loads_there():
    """slime parses --sglang-* flags with SGLang's own parser (sglang_utils/arguments.py:41-121, 203-230) in its
    driver, where no SGLang plugin has run: `--quantization` takes a closed list of choices that only a plugin's
    register() extends, so `--sglang-quantization qurl_int8` is refused there (as a fresh interpreter shows;
    registration is process-wide, so this test checks the list, not a fresh process). Set in the
    --custom-config-path YAML, the value reaches ServerArgs(**kwargs) in the engine actor (sglang_engine.py:174,
    575-582), which takes it, and the server process that actor spawns (sglang_engine.py:48-52) runs SGLang's
    plugin loader, which finds our entry point (setup.py, group sglang.srt.plugins)."""
    import argparse

    import qurl_mcore.sglang
    from qurl_mcore.models.tiny import tiny_checkpoint
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if "--quantization" in a.option_strings)
    assert action.choices is QUANTIZATION_CHOICES
    server = ServerArgs(model_path=str(tiny_checkpoint("llama")), quantization="qurl_int8", device="cpu")
    assert server.quantization == "qurl_int8"
    func, dist = load_plugins_by_group(GENERAL_PLUGINS_GROUP)["qurl"]
    assert func is qurl_mcore.sglang.register and dist == "qurl-mcore"


@pytest.mark.slow
def test_the_plugin_serves_and_refits_in_slimes_sglang(tmp_path):
    """slime's image pins SGLang 0.5.15.post1 (docker/Dockerfile:1). In a subprocess with that SGLang first on
    the path (requirements/slime-sglang.txt), SGLang's plugin loader finds our entry point in the engine and its
    scheduler, and each case's engine computes the quantized reference forward at load and after a partial push
    of new weights (re-quantized on arrival; tolerance: tests/sglang/test_engine_numerics.py). Each of slime's
    three pushes reaches the engine: the originals back as flattened buckets, then as tensors, give the
    load-time log-probs bitwise; the new weights again over a gloo weight group give the tensor push's."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from qurl_mcore.sglang import QurlOptions
    from tests.integrations.slime_sglang import CASES
    from tests.sglang.conftest import checkpoint_tensors, model_path, noisy_layer0, write_checkpoint
    from tests.sglang.reference import reference_model, token_logprobs

    root = Path(__file__).parents[2]
    slime_sglang = Path(sys.executable).parents[1] / "slime-sglang"
    assert (slime_sglang / "sglang").is_dir(), f"{slime_sglang}: missing; run bash launch/setup_env.sh --with-test"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slime_sglang), str(root)])}
    done = subprocess.run([sys.executable, "-m", "tests.integrations.slime_sglang"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, (done.stdout + done.stderr)[-4000:]
    result = json.loads(line[len("RESULT "):])
    assert result["sglang"] == "0.5.15.post1"
    for case, (model, method, options) in zip(result["cases"], CASES, strict=True):
        opts = QurlOptions.parse(method, options)
        path = model_path(model)
        original = checkpoint_tensors(path)
        for key, weights in (("base", path), ("noisy", write_checkpoint(path, noisy_layer0(original),
                                                                        tmp_path / f"{method}-noisy"))):
            want = token_logprobs(reference_model(weights, opts.recipe.spec, opts.scope, torch.float32), case["seq"])
            diff = (torch.tensor(case[key]) - want).abs().max()
            assert diff < 2e-3, f"{method} {key}: max |Δ| {diff:.2e}"
        assert case["noisy"] != case["base"], method
        assert case["restored_flattened"] == case["restored"] == case["base"], method
        assert case["noisy_distributed"] == case["noisy"], method
