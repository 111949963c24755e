"""What one SGLang generation returns, as the RL loop needs it."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Generation:
    """One sampled completion.

    `output_logprobs[i]` is the behaviour log-probability log π_behav(output_ids[i] | prefix): SGLang's
    log_softmax(logits / temperature) before top-k/top-p filtering. `prompt_logprobs[j]` scores prompt token
    j+1 teacher-forced (present when the request set `logprob_start_len=0`). `routed_experts` has shape
    [prompt + output - 1, layers, top_k]: the experts each forwarded token was routed to in every MoE layer
    (present when requested from an engine started with `return_routed_experts`).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    prompt_logprobs: list[float] | None
    text: str
    finish_reason: Any
    weight_version: str | None
    routed_experts: np.ndarray | None = None


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang ships routed expert ids as base64 of int32 [tokens, layers, top_k]."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return flat.reshape(-1, num_layers, top_k)


class RequestRefused(ValueError):
    """The engine refused a request (a prompt longer than its context length, a request its KV cache cannot
    hold): the request's error, which restarting the engine cannot fix."""


class NonFiniteLogprobs(ValueError):
    """The engine returned a NaN or +inf log-probability (SGLang's JSON carries NaN as null): the weights it
    serves, or its activations, are non-finite; restarting the engine cannot fix it."""


def _logprobs(entries: list, what: str) -> list[float]:
    """The log-probs of SGLang's (log-prob, token id, ...) `entries`; NonFiniteLogprobs naming the first bad
    one of `what` when one is NaN (null) or +inf (-inf is a probability of 0, which a prompt token can have)."""
    values = [float("nan") if t[0] is None else float(t[0]) for t in entries]
    bad = [i for i, v in enumerate(values) if v != v or v == float("inf")]
    if bad:
        raise NonFiniteLogprobs(f"the engine returned {len(bad)} non-finite log-prob(s) of {len(values)} for the "
                                f"{what} tokens, the first at token {bad[0]} ({values[bad[0]]}): the weights it "
                                "serves or its activations are NaN/Inf; check the model's and the pushed weights "
                                "(train/grad_norm, train/skipped_nonfinite)")
    return values


def _refusal(out: Any) -> str | None:
    """SGLang's reason if `out` is a refusal rather than a generation, else None. Two shapes (0.5.23): a
    request refused before scheduling answers `{"error": {"message": ...}}` (HTTP 400, `_create_error_response`);
    one the scheduler aborts comes back with `meta_info.finish_reason = {"type": "abort", "message": ...}`."""
    if not isinstance(out, dict):
        return f"an answer that is not a generation: {str(out)[:200]!r}"
    if "error" in out:
        error = out["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    reason = out.get("meta_info", {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message") or "aborted")
    return None


def parse_batch(outs: Any, input_ids: list[list[int]], moe_shape: tuple[int, int] | None) -> list[Generation]:
    """The `Generation`s of one /generate call of len(input_ids) prompts. RequestRefused names the prompt (its
    index and length) and SGLang's reason when the engine refused the call or one of its requests;
    NonFiniteLogprobs names the prompt and the token whose log-prob is NaN or +inf."""
    longest = max(range(len(input_ids)), key=lambda i: len(input_ids[i]), default=0)
    problem = _refusal(outs) if not isinstance(outs, list) else None
    if problem is not None:  # the whole call refused: SGLang checks every prompt before it schedules any
        raise RequestRefused(f"the engine refused {len(input_ids)} prompt(s) (the longest, #{longest}, has "
                             f"{len(input_ids[longest]) if input_ids else 0} tokens): {problem}")
    for i, out in enumerate(outs):
        problem = _refusal(out)
        if problem is not None:
            raise RequestRefused(f"the engine refused prompt #{i} ({len(input_ids[i])} tokens): {problem}")
    parsed = []
    for i, (out, ids) in enumerate(zip(outs, input_ids)):
        try:
            parsed.append(parse(out, ids, moe_shape))
        except NonFiniteLogprobs as err:
            raise NonFiniteLogprobs(f"prompt #{i}: {err}") from None
    return parsed


def parse(out: dict[str, Any], prompt_ids: list[int], moe_shape: tuple[int, int] | None) -> Generation:
    """A `Generation` from one SGLang response dict (Engine.generate or HTTP /generate)."""
    meta = out["meta_info"]
    output = meta["output_token_logprobs"]
    prompt = meta.get("input_token_logprobs")
    routed = meta.get("routed_experts")
    return Generation(
        prompt_ids=list(prompt_ids),
        output_ids=[int(t[1]) for t in output],
        output_logprobs=_logprobs(output, "output"),
        prompt_logprobs=_logprobs(prompt[1:], "prompt") if prompt else None,  # token 0 has no log-prob
        text=out.get("text", ""),
        finish_reason=meta.get("finish_reason"),
        weight_version=meta.get("weight_version"),
        routed_experts=decode_routed_experts(routed, *moe_shape) if routed and moe_shape else None,
    )
