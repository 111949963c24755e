"""ACR and acr_symmetric as verl 0.9.1 policy losses (`actor_rollout_ref.actor.policy_loss.loss_mode=acr`).

Importing this module registers them in verl's registry (`verl.trainer.ppo.core_algos.register_policy_loss`); a
run imports it with `actor_rollout_ref.model.external_lib=qurl_mcore.integrations.verl` (docs/integrations.md).

verl calls a policy loss with π_θ's and π_prox's log-probs (`log_prob`, `old_log_prob`), per-token advantages, the
response mask, its `loss_agg_mode`, the actor config and `rollout_is_weights`, never with the rollout's log-probs.
With `algorithm.rollout_correction.rollout_is=token` and a threshold that truncates nothing (`inf`) those weights
are r = π_prox/π_behav per token, so log π_behav = log π_prox − log r, and the loss is `policy_loss` on them with
eps_low/eps_high = the actor's `clip_ratio_low`/`clip_ratio_high` (`clip_ratio` where unset) and tis_cap = the
actor's `policy_loss.rollout_correction.rollout_is_threshold` (a key verl itself reads only in bypass mode).

verl's trainer normalises every micro-batch's loss by the whole mini-batch (`config.global_batch_info`: its
response tokens or its sequences, over all data-parallel ranks, times the DP size), so that micro-batches and
ranks add up to the mini-batch's loss. `policy_loss` normalises by the micro-batch, so its loss is rescaled by
units · dp_size / (the mini-batch's units), `aggregation_units` being what it divided by.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor
from verl.trainer.ppo.core_algos import register_policy_loss

from qurl_mcore.rl.losses import aggregation_units, policy_loss

REGISTERED_LOSSES = ("acr", "acr_symmetric")

# verl's loss_agg_mode -> (our aggregation, the `global_batch_info` entry verl normalises that mode by).
# 'token-sum' and 'seq-mean-token-sum-norm' have no counterpart in qurl_mcore.rl.losses.AGGREGATIONS.
AGG_MODES = {
    "token-mean": ("token_mean", "batch_num_tokens"),
    "seq-mean-token-mean": ("seq_mean_token_mean", "global_batch_size"),
    "seq-mean-token-sum": ("seq_mean_token_sum", "global_batch_size"),
}


def verl_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
    *,
    method: str,
) -> tuple[Tensor, dict[str, float]]:
    """verl 0.9.1's policy-loss signature (verl/workers/utils/losses.py passes these by name) over
    `policy_loss(method=method)`: returns the loss verl backpropagates and our metrics under ``actor/``."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not supported by loss_mode={method}; set "
                         f"actor_rollout_ref.actor.loss_agg_mode to one of {list(AGG_MODES)}")
    if config is None:
        raise ValueError(f"loss_mode={method} needs verl's actor config (clip ratios, rollout_correction)")
    if rollout_is_weights is None:
        raise ValueError(
            f"loss_mode={method} needs the rollout log-probs, which verl passes as rollout_is_weights: set "
            "actor_rollout_ref.rollout.calculate_log_probs=true, algorithm.rollout_correction.rollout_is=token "
            "and algorithm.rollout_correction.rollout_is_threshold=inf")
    mask = response_mask.bool()
    if not mask.any():  # e.g. every sequence rejected by rollout_rs: verl's losses contribute nothing
        return log_prob[mask].sum(), {}
    if not (rollout_is_weights[mask] > 0).all():
        raise ValueError(
            f"loss_mode={method} got rollout_is_weights of 0 at response tokens, so the rollout log-probs cannot "
            "be recovered; set algorithm.rollout_correction.rollout_is_threshold=inf (not a 'lower_upper' range)")
    agg, total_key = AGG_MODES[loss_agg_mode]
    loss, metrics = policy_loss(log_prob, old_log_prob, old_log_prob - rollout_is_weights.log(), advantages, mask,
                                method=method, agg=agg, **_clip_options(config))
    info = config.get("global_batch_info") or {}
    dp_size, total = info.get("dp_size") or 1, info.get(total_key)
    if total is None and dp_size > 1:
        raise ValueError(f"global_batch_info has no {total_key!r} with dp_size={dp_size}; verl's trainer sets it")
    scale = 1.0 if total is None else int(aggregation_units(mask, agg)) * dp_size / float(total)
    return loss * scale, {f"actor/{name}": value for name, value in metrics.items()}


def _clip_options(config: Any) -> dict[str, float]:
    """eps_low, eps_high and tis_cap from verl's actor config (module docstring); tis_cap keeps `policy_loss`'s
    default when the config holds no rollout_correction."""
    clip = config.get("clip_ratio")
    low, high = config.get("clip_ratio_low"), config.get("clip_ratio_high")
    options = {"eps_low": clip if low is None else low, "eps_high": clip if high is None else high}
    correction = (config.get("policy_loss") or {}).get("rollout_correction") or {}
    cap = correction.get("rollout_is_threshold")
    if cap is not None:
        if isinstance(cap, str) and "_" in cap:  # verl reads "lower_upper" as an IcePop range
            raise ValueError(f"actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold={cap!r} "
                             "is ACR's tis_cap: give one number (>= 1)")
        options["tis_cap"] = float(cap)
    return options


def uaq_start_checkpoint(hf_dir: str | Path, out_dir: str | Path, uaq_scale: float) -> Path:
    """`hf_dir`, an HF checkpoint, written to `out_dir` in UAQ's parameterisation with factor s = `uaq_scale`
    (QuRL §4.3, `qurl_mcore.uaq`): the same model, each tensor times s^k for its role, in fp32, stored in its
    own dtype. A verl run that starts from it (`actor_rollout_ref.model.path`) trains with UAQ: its optimizer
    holds the scaled weights from the first step, and its weight updates push them as they are, which the
    engine serves and re-quantizes as it does any weights. `qurl export DIR OUT --uaq-scale s` takes one of
    the run's HF checkpoints back to the usual parameterisation."""
    from qurl_mcore.megatron.export import unscale_hf_checkpoint  # lazy: loads Megatron-Core

    if not uaq_scale > 0:
        raise ValueError(f"uaq_scale {uaq_scale}: the UAQ factor s is positive (QuRL's 1.5)")
    return unscale_hf_checkpoint(hf_dir, out_dir, 1.0 / uaq_scale)  # unscaling by 1/s scales by s


for _method in REGISTERED_LOSSES:
    register_policy_loss(_method)(partial(verl_policy_loss, method=_method))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qurl_mcore.integrations.verl",
                                     description=uaq_start_checkpoint.__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", help="the base model's HF checkpoint directory")
    parser.add_argument("out_dir", help="the UAQ-scaled copy to write (verl's actor_rollout_ref.model.path)")
    parser.add_argument("--uaq-scale", type=float, default=1.5, help="UAQ's s (default 1.5, QuRL's)")
    args = parser.parse_args()
    print(uaq_start_checkpoint(args.hf_dir, args.out_dir, args.uaq_scale))
