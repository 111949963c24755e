"""slime (THUDM/slime, read at commit 624b824a) running QuRL's ACR loss, our precision specs and UAQ.

slime loads each piece by dotted path (slime/utils/misc.py:39-47); docs/integrations.md has the launch command:

  --loss-type custom_loss --custom-loss-function-path qurl_mcore.integrations.slime.acr_loss
  --custom-model-provider-path qurl_mcore.integrations.slime.model_provider
  --custom-megatron-before-train-step-hook-path qurl_mcore.integrations.slime.uaq_hook
  --custom-config-path qurl.yaml

slime sets every key of the `--custom-config-path` YAML on its args (slime/utils/arguments.py:2013-2018); ours
are `qurl_precision` (a row of qurl_mcore/precision.py), `qurl_scope`, `qurl_fp4_format`, `qurl_uaq_scale`, and
the engines' `sglang_quantization`, which goes there because slime parses `--sglang-quantization` against
SGLang's closed list of choices before any plugin has registered ours (sglang_utils/arguments.py:41-121, 203-230).
The loss reads slime's own names: ε_low = --eps-clip, ε_high = --eps-clip-high, C = --tis-clip.
"""
from __future__ import annotations

import importlib.util
import json
import re
from argparse import Namespace
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qurl_mcore.config import UAQConfig
from qurl_mcore.precision import Precision, select, uaq_scope
from qurl_mcore.recipe import resolve
from qurl_mcore.rl import metrics as M
from qurl_mcore.rl.losses import policy_loss
from qurl_mcore.sglang.options import QurlOptions

#: slime flags ACR cannot honour -> the fix; checked before every loss (a custom loss skips the code they drive)
REFUSED_FLAGS = {
    "use_rollout_logprobs": "ACR needs π_prox (the trainer's recomputed log-probs) apart from the rollout's; "
                            "drop --use-rollout-logprobs",
    "use_tis": "ACR already weighs each token by min(r, --tis-clip); drop --use-tis",
    "tis_clip_low": "ACR truncates r = π_prox/π_behav from above only (at --tis-clip); drop --tis-clip-low",
    "custom_tis_function_path": "ACR does its own importance weighting; drop --custom-tis-function-path",
    "eps_clip_c": "ACR has no dual clip; drop --eps-clip-c",
    "use_opsm": "ACR does not mask sequences (OPSM); drop --use-opsm",
    "custom_pg_loss_reducer_function_path": "ACR reduces with slime's own sum_of_sample_mean; drop "
                                            "--custom-pg-loss-reducer-function-path",
    "use_unbiased_kl": "the KL term here is the plain k1/k3 estimate; drop --use-unbiased-kl",
}
#: slime's --kl-loss-type -> our estimator (`qurl_mcore.rl.metrics.kl_per_token`); low_var_kl is k3 clamped to ±10
KL_TYPES = {"k1": "k1", "k3": "k3"}
#: metrics of `policy_loss` that are token means over the micro-batch (reported weighted, see `acr_loss`)
TOKEN_MEAN_METRICS = ("clip_frac/low", "clip_frac/high", "is_ratio/mean", "is_ratio/truncated_frac",
                      "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_logprob_diff")


# ---- the loss ----------------------------------------------------------------------------------------------

def acr_loss(args: Namespace, batch: dict, logits: Tensor,
             sum_of_sample_mean: Callable[[Tensor], Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's `--custom-loss-function-path`: QuRL's ACR objective, `policy_loss(method="acr")`.

    slime calls it as func(args, batch, logits, sum_of_sample_mean) (backends/megatron_utils/loss.py:1334-1342)
    with logits [1, T, V/TP] float32 for the micro-batch's packed sequences. The current log-probs come from
    slime's own helper, as its built-in losses get them (TP vocabulary shards, context parallelism,
    --rollout-temperature, top-p replay: loss.py:513, 83). Per sample, `batch` holds "log_probs" (π_prox, the
    trainer's recompute, always made for a custom loss: actor.py:461-486), "rollout_log_probs" (π_behav from
    SGLang) and "advantages", each a float32 [R_i] tensor on this context-parallel rank's tokens.

    The loss is slime's reduction of the per-token objective J: −sum_of_sample_mean(J), plus
    --kl-loss-coef·sum_of_sample_mean(KL) with --use-kl-loss and −--entropy-coef·sum_of_sample_mean(entropy).
    sum_of_sample_mean is linear, Σ_t w_t·x_t with w_t ≥ 0, and J is positively homogeneous in the advantage
    (J(w·A) = w·J(A) for w ≥ 0), so the ACR term is exactly policy_loss on one row of all tokens with
    advantages w·A and agg "seq_mean_token_sum". Metrics are 0-d tensors in slime's reduction space: the loss
    terms as they enter the loss, and TOKEN_MEAN_METRICS times Σ_t w_t, so slime's step reduction (sum over
    micro-batches and ranks, then divide: observability/train_metric_utils.py:45-59) gives their mean weighted
    as the loss weighs tokens.
    """
    # slime's own modules: this module is a plugin that slime loads
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs

    check_loss_args(args)
    _, out = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=args.entropy_coef != 0,
        **get_rollout_top_p_logprob_kwargs(args, batch))
    return acr_loss_from_logprobs(args, batch, out["log_probs"], sum_of_sample_mean, logits=logits,
                                  entropy=out.get("entropy"))


def check_loss_args(args: Namespace) -> None:
    """Raise, naming the fix, for slime settings ACR would silently ignore (REFUSED_FLAGS and the rest)."""
    for flag, fix in REFUSED_FLAGS.items():
        if getattr(args, flag, None):
            raise ValueError(f"{flag}={getattr(args, flag)!r} with the ACR loss: {fix}")
    if args.advantage_estimator in ("gspo", "cispo"):
        raise ValueError(f"--advantage-estimator {args.advantage_estimator} names its own objective; ACR is "
                         "token-level PPO-style: use grpo, reinforce_plus_plus(_baseline) or ppo")
    if args.use_kl_loss and args.kl_loss_coef != 0 and args.kl_loss_type not in KL_TYPES:
        raise ValueError(f"--kl-loss-type {args.kl_loss_type} with the ACR loss: use one of {list(KL_TYPES)} "
                         "(k3 is low_var_kl without its clamp to ±10)")


def acr_loss_from_logprobs(args: Namespace, batch: dict, log_probs: Sequence[Tensor],
                           sum_of_sample_mean: Callable[[Tensor], Tensor], *, logits: Tensor,
                           entropy: Sequence[Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """`acr_loss` once the current per-sample log-probs (and entropy, with --entropy-coef) are computed;
    `logits` only anchors an empty micro-batch's zero loss to the graph (as slime does, loss.py:1133)."""
    if not batch.get("log_probs"):
        raise ValueError("the batch has no 'log_probs' (π_prox): ACR needs slime's recompute with the trainer, "
                         "which a custom loss always gets unless --use-rollout-logprobs is set")
    if not batch.get("rollout_log_probs"):
        raise ValueError("the batch has no 'rollout_log_probs' (π_behav): roll out with slime's SGLang rollout, "
                         "which asks the engines for log-probs (rollout/sglang_rollout.py:176-179)")
    lp = torch.cat(list(log_probs))
    weights = reducer_weights(sum_of_sample_mean, lp)
    mask = weights > 0
    kl_on = args.use_kl_loss and args.kl_loss_coef != 0
    keys = ["loss/total", "loss/policy", *TOKEN_MEAN_METRICS, *(["kl_ref"] if kl_on else []),
            *(["entropy"] if args.entropy_coef != 0 else [])]
    if not mask.any():  # e.g. a context-parallel rank holding only prompt tokens of this micro-batch
        zero = 0 * logits.sum()
        return zero, {k: zero.detach() for k in keys}
    eps_high = args.eps_clip if args.eps_clip_high is None else args.eps_clip_high
    policy, stats = policy_loss(
        lp[None], torch.cat(batch["log_probs"])[None], torch.cat(batch["rollout_log_probs"])[None],
        (torch.cat(batch["advantages"]) * weights)[None], mask[None], method="acr", eps_low=args.eps_clip,
        eps_high=eps_high, tis_cap=args.tis_clip, agg="seq_mean_token_sum")
    mass = weights.sum().item()
    metrics = {"loss/policy": policy.detach(), **{k: lp.new_tensor(stats[k] * mass) for k in TOKEN_MEAN_METRICS}}
    loss = policy
    if kl_on:
        kl = sum_of_sample_mean(M.kl_per_token(lp, torch.cat(batch["ref_log_probs"]), KL_TYPES[args.kl_loss_type]))
        loss = loss + args.kl_loss_coef * kl
        metrics["kl_ref"] = kl.detach()
    if args.entropy_coef != 0:
        ent = sum_of_sample_mean(torch.cat(list(entropy)))
        loss = loss - args.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    metrics["loss/total"] = loss.detach()
    return loss, {k: metrics[k] for k in keys}


def reducer_weights(sum_of_sample_mean: Callable[[Tensor], Tensor], like: Tensor) -> Tensor:
    """The per-token weights w of slime's reducer (sum_of_sample_mean(x) = Σ_t w_t·x_t: its gradient), shaped
    like `like`. The reducer is slime's (backends/megatron_utils/cp_utils.py:47-124): per-sample or
    per-rollout denominators, per-token sums, context-parallel chunks; this stays right for all of them."""
    x = torch.zeros_like(like, dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        (w,) = torch.autograd.grad(sum_of_sample_mean(x), x)
    if (w < 0).any():
        raise ValueError("slime's sum_of_sample_mean weighs some token negatively; ACR's reduction needs w >= 0")
    return w


# ---- the trainer side of a precision -----------------------------------------------------------------------

def precision_of(args: Namespace) -> tuple[Precision, str, str | None]:
    """(precision row, scope, format) from the YAML keys on slime's args, checked against what the engines
    run (`sglang_quantization` and the quantization_config of `sglang_json_model_override_args`), as our own
    loop refuses to train when trainer and engines disagree."""
    name = getattr(args, "qurl_precision", None)
    if name is None:
        raise ValueError("qurl_precision is not set: put e.g. 'qurl_precision: int8' (a row of "
                         "qurl_mcore/precision.py) in the YAML of --custom-config-path")
    p, scope, fmt = select(name, getattr(args, "qurl_scope", "auto"), getattr(args, "qurl_fp4_format", None))
    method = getattr(args, "sglang_quantization", None)
    if method != p.rollout:
        raise ValueError(f"qurl_precision {p.name!r} rolls out with {p.rollout!r} but the engines run "
                         f"sglang_quantization={method!r}: set 'sglang_quantization: {p.rollout}' in the YAML")
    if method is not None:
        overrides = json.loads(getattr(args, "sglang_json_model_override_args", None) or "{}")
        engines = QurlOptions.parse(method, overrides.get("quantization_config"))
        if (engines.fmt, engines.scope) != (fmt, scope):
            raise ValueError(f"the trainer quantizes scope {scope!r} in {fmt!r} but the engines {engines.scope!r} in "
                             f"{engines.fmt!r}: give both the same (qurl_scope/qurl_fp4_format and the "
                             "quantization_config of sglang_json_model_override_args)")
    return p, scope, fmt


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    """slime's `--custom-model-provider-path` (signature: slime/utils/arguments.py:227-236; called from
    backends/megatron_utils/model_provider.py:97-110). Builds `gpt_model` from Megatron's global args and the
    TransformerConfig slime's default provider derives from them, and teaches slime's weight converters the
    names our spec gives its parameters (`te_name`)."""
    # Megatron's training arguments: only inside slime's Megatron actor
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    _teach_converters()
    return gpt_model(args, core_transformer_config_from_args(args), pre_process=pre_process,
                     post_process=post_process, vp_stage=vp_stage)


def gpt_model(args: Namespace, config, *, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None):
    """A GPTModel whose layers are `qurl_mcore.megatron.spec.gpt_spec(config, qurl_precision, ...)` (the
    trainer side of the precision: RC in forward and backward for fp4_rc), with the other GPTModel arguments
    slime's default provider passes (model_provider.py:200-214). slime packs a micro-batch's sequences into one
    THD row (backends/megatron_utils/data.py:93-104), which of Megatron's core attentions only Transformer
    Engine's takes, so that one is used when installed (Megatron's local one otherwise, e.g. on a CPU)."""
    # Megatron-Core: only inside slime's Megatron actor, where the model is built
    from megatron.core.models.gpt import GPTModel

    from qurl_mcore.megatron.spec import gpt_spec

    p, scope, fmt = precision_of(args)
    if config.virtual_pipeline_model_parallel_size or vp_stage is not None:
        raise ValueError("gpt_spec builds one pipeline stage's layers without virtual stages: drop "
                         "--num-layers-per-virtual-pipeline-stage")
    if getattr(args, "mtp_num_layers", None):
        raise ValueError("multi-token prediction layers are not built by gpt_spec: drop --mtp-num-layers")
    if config.num_moe_experts and config.expert_model_parallel_size > 1:
        raise ValueError("slime gives experts global indices only under Transformer Engine's grouped-GEMM names "
                         "(update_weight/common.py:224-231), not gpt_spec's SequentialMLP: use "
                         "--expert-model-parallel-size 1")
    spec = gpt_spec(config, resolve(p.name, scope, fmt))
    if importlib.util.find_spec("transformer_engine") is not None:
        # Transformer Engine only where it is installed (absent on CPUs)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        for layer in {id(s): s for s in spec.layer_specs}.values():
            layer.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)


#: gpt_spec's parameter names -> the Transformer Engine spec's, the only ones slime's weight converters know
#: (megatron_to_hf/qwen2.py:60-63, llama.py:46-51, qwen3moe.py:26-43, 100-105): the norms are fused into the
#: next linear there, and experts are grouped-GEMM weights with the expert index at the end
TE_NAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.input_layernorm\.weight$", ".self_attention.linear_qkv.layer_norm_weight"),
    (r"\.pre_mlp_layernorm\.weight$", ".mlp.linear_fc1.layer_norm_weight"),
    (r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".mlp.experts.\2.weight\1"),
))


def te_name(name: str) -> str:
    """`name` (a gpt_spec parameter) as the Transformer Engine spec names the same tensor."""
    for pattern, replacement in TE_NAMES:
        name = pattern.sub(replacement, name)
    return name


def _teach_converters() -> None:
    """Route slime's conversion to HF names (megatron_to_hf/__init__.py:41, looked up at each call by
    `convert_to_hf`) through `te_name`. Idempotent."""
    # slime's own modules: this module is a plugin that slime loads
    from slime.backends.megatron_utils import megatron_to_hf

    core = megatron_to_hf._convert_to_hf_core
    if getattr(core, "qurl_te_names", False):
        return

    def convert(args, model_name, name, param):
        return core(args, model_name, te_name(name), param)

    convert.qurl_te_names = True
    megatron_to_hf._convert_to_hf_core = convert


# ---- UAQ -------------------------------------------------------------------------------------------------

def uaq_hook(args: Namespace, rollout_id: int, step_id: int, model: Sequence[torch.nn.Module], optimizer,
             opt_param_scheduler) -> None:
    """slime's `--custom-megatron-before-train-step-hook-path` (called at the start of every train step with
    the DDP model chunks and the Megatron optimizer: backends/megatron_utils/model.py:557-561): applies UAQ
    (`qurl_mcore.megatron.apply_uaq`, s = `qurl_uaq_scale`, default UAQConfig's, over the precision's UAQ scope,
    `qurl_mcore.precision.uaq_scope`) to the actor once.

    Once: the chunks are marked, and only a run that started from the base weights is scaled (slime sets
    args.finetune when --load holds no slime checkpoint: utils/arguments.py:1817-1838); a resumed run loads
    weights that are already scaled. The optimizer's fp32 main weights are refreshed from the rescaled model
    (`reload_model_params`), else its next step would write the unscaled weights back. The rollout before the
    first step used the unscaled weights: the same function, so nothing is lost; slime's next weight push
    sends the scaled ones (train.py:85)."""
    # Megatron-Core (qurl_mcore.megatron): only inside slime's Megatron actor
    from qurl_mcore.megatron import apply_uaq

    if getattr(model[0], "role", "actor") != "actor" or getattr(model[0], "qurl_uaq_scale", None) is not None:
        return
    p, scope, _ = precision_of(args)
    try:
        scope = uaq_scope(p.name, scope)
    except ValueError as err:
        raise ValueError(f"{err} (here: drop --custom-megatron-before-train-step-hook-path)") from None
    scale = float(getattr(args, "qurl_uaq_scale", UAQConfig.scale))
    fused = [n for chunk in model for n, _ in chunk.named_parameters() if ".layer_norm_weight" in n]
    if fused:
        raise ValueError(f"{fused[0]}: a Transformer Engine layer (norm fused into the linear), whose names "
                         "apply_uaq does not rescale; build the model with --custom-model-provider-path "
                         "qurl_mcore.integrations.slime.model_provider")
    if args.finetune:
        for chunk in model:
            apply_uaq(chunk, scale, scope)
        optimizer.reload_model_params()
    for chunk in model:
        chunk.qurl_uaq_scale = scale
