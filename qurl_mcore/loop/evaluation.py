"""Held-out evaluation (`eval.*`, `qurl eval`): how often the model users deploy, the rollout engines'
quantized copy, answers prompts the run does not train on, and how often a BF16 engine with the same weights
does (`eval.bf16_reference`); the gap between the two is what quantized rollout costs in accuracy.

Over P prompts with n samples each and rewards r[p, i] in [0, 1]:
  accuracy   = mean over p and i of r[p, i]: pass@1 with greedy decoding (n = 1), mean@n with sampling
  pass_at_n  = mean over p of max_i r[p, i] (n > 1): a prompt counts when one of its samples is right
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch

from qurl_mcore.config import Config
from qurl_mcore.heldout import eval_examples, greedy_repeats
from qurl_mcore.models import resolve_model_path
from qurl_mcore.tasks import Example, chat_ids, load_reward, score_all
from qurl_mcore.tasks.rewards import RewardFn

if TYPE_CHECKING:
    from qurl_mcore.rollout import Generation

#: the name suffix of the BF16 reference engine's metrics
BF16_SUFFIX = "_bf16"


def sampling(cfg: Config) -> dict:
    """SGLang sampling parameters: greedy at `eval.temperature` 0, else the rollout's top_p and top_k."""
    r, e = cfg.rollout, cfg.eval
    out = {"max_new_tokens": r.max_new_tokens, "temperature": e.temperature}
    if e.temperature > 0:
        out.update(top_p=r.top_p, top_k=r.top_k)
    return out


def _groups(rewards: Sequence[float], n: int) -> list[Sequence[float]]:
    if n < 1 or not rewards or len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of n={n} samples per prompt")
    return [rewards[i:i + n] for i in range(0, len(rewards), n)]


def accuracy(rewards: Sequence[float], n: int) -> float:
    """Mean reward over prompts and samples (prompt after prompt, n samples each): pass@1 for n = 1 greedy
    samples, mean@n for n sampled ones."""
    _groups(rewards, n)
    return sum(rewards) / len(rewards)


def pass_at_n(rewards: Sequence[float], n: int) -> float:
    """Mean over prompts of the best of their n rewards."""
    groups = _groups(rewards, n)
    return sum(max(g) for g in groups) / len(groups)


def score(reward_fn: RewardFn, generations: list[Generation], answers: list[str], n: int, max_new_tokens: int,
          suffix: str = "") -> tuple[dict[str, float], list[float]]:
    """The eval/* metrics of `generations` (n per prompt, prompt after prompt; `answers` alike), each name
    followed by `suffix`, and the rewards: accuracy, pass_at_n (n > 1), response_len_mean, truncated_frac
    (responses that reached `max_new_tokens`: raise it if many did)."""
    rewards, _ = score_all(reward_fn, [g.text for g in generations], answers)
    lengths = [len(g.output_ids) for g in generations]
    metrics = {"eval/accuracy": accuracy(rewards, n),
               "eval/response_len_mean": sum(lengths) / len(lengths),
               "eval/truncated_frac": sum(length >= max_new_tokens for length in lengths) / len(lengths)}
    if n > 1:
        metrics["eval/pass_at_n"] = pass_at_n(rewards, n)
    return {f"{k}{suffix}": v for k, v in metrics.items()}, rewards


def samples(examples: list[Example], n: int, generations: list[Generation], rewards: list[float]) -> list[dict]:
    """One record per generation (n per example, example after example): prompt (the last message), answer,
    response, reward."""
    asked = [ex for ex in examples for _ in range(n)]
    return [{"prompt": ex.messages[-1]["content"], "answer": ex.answer, "response": g.text, "reward": reward}
            for ex, g, reward in zip(asked, generations, rewards, strict=True)]


def eval_prompts(cfg: Config, held_out: bool = True) -> list[Example]:
    """`qurl eval`'s prompts: `eval.data`'s, or task addition's generated ones, leaving out `cfg`'s training
    prompts when `held_out` (see `evaluate_model`). Raises ValueError naming the field to fix."""
    from .sampler import load_prompt_set  # sampler imports this module

    generated_split = not cfg.eval.data and cfg.data.task == "addition"
    return eval_examples(cfg, load_prompt_set(cfg) if generated_split and held_out else [])


def evaluate_model(cfg: Config, model_path: str, startup_timeout: float = 600.0, held_out: bool = True) -> dict:
    """`qurl eval`: the evaluation `cfg` describes, on the HF checkpoint `model_path` (or a name `model.path`
    takes) served by one engine of `cfg.precision` started here (as the loop starts them, without Ray).
    `held_out`: task addition's generated prompts leave out `cfg`'s training prompts (False: no training run
    is known, any additions). Returns {"metrics": eval/*, "samples": `samples`}."""
    from transformers import AutoTokenizer  # only `qurl eval` needs a tokenizer here, not the loop

    from .sampler import EngineHost, engine_config  # sampler imports this module

    if greedy_repeats(cfg):
        raise ValueError(greedy_repeats(cfg))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, offload=False))  # no trainer here
    examples = eval_prompts(cfg, held_out)
    model_path = str(resolve_model_path(model_path))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    n = cfg.eval.n
    ids = [chat_ids(tokenizer, ex, cfg.data.system_prompt) for ex in examples]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    host = EngineHost(engine_config(cfg, cfg.recipe().engine, model_path, device),
                      startup_timeout=startup_timeout)
    try:
        generations = host.generate([i for i in ids for _ in range(n)], sampling(cfg))
    finally:
        host.shutdown()
    metrics, rewards = score(load_reward(cfg.data.reward), generations, [ex.answer for ex in examples for _ in range(n)],
                             n, cfg.rollout.max_new_tokens)
    return {"metrics": metrics, "samples": samples(examples, n, generations, rewards)}
