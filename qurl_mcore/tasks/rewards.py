"""Rewards: response text and ground truth in, a score in [0, 1] out. A reward function that raises scores 0
and is counted (`score_all`), so one malformed answer never kills a run."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

RewardFn = Callable[[str, str], float]
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to `answer` (numbers, fractions, LaTeX,
    \\boxed{}), else 0.0. Timeouts are off: they rely on SIGALRM, which only the main thread may use."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0


def first_number_reward(response: str, answer: str) -> float:
    """1.0 if the first number in the response equals `answer` exactly (the synthetic task's check)."""
    match = _FIRST_NUMBER.search(response)
    return 1.0 if match is not None and float(match.group()) == float(answer) else 0.0


REWARDS: dict[str, RewardFn] = {"math": math_reward, "first_number": first_number_reward}


@dataclass
class RewardStats:
    errors: int = 0
    messages: list[str] = field(default_factory=list)


def score_all(fn: RewardFn, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
    """Score every response; an exception (or a non-finite score) gives 0 and is recorded in the stats."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    scores, stats = [], RewardStats()
    for response, answer in zip(responses, answers):
        try:
            score = float(fn(response, answer))
            if score != score or score in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite reward {score}")
        except Exception as err:  # noqa: BLE001 - any failure of user reward code is scored, never fatal
            stats.errors += 1
            stats.messages.append(f"{type(err).__name__}: {err}")
            score = 0.0
        scores.append(score)
    return scores, stats
