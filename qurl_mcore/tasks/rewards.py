"""Rewards: response text and ground truth in, a score out (the built-in ones: in [0, 1]). A reward function
that raises scores 0 and is counted (`score_all`), so one malformed answer never kills a run.

`data.reward` names one of `REWARDS` or the user's own function as `package.module:function` (importable where
the run runs), of one of these forms:

    def f(response: str, answer: str) -> float                        # per sample
    def f(responses: list[str], answers: list[str]) -> list[float]    # batched: its first parameter is a list
    async def f(...)                                                  # either, run with asyncio

A per-sample function is called once per response (async ones concurrently); a batched one once per batch of
a step's responses, and when it raises, every response of the batch scores 0 and is counted.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Callable

RewardFn = Callable[[str, str], float]
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to `answer` (numbers, fractions, LaTeX,
    \\boxed{}), else 0.0. Timeouts are off: they rely on SIGALRM, which only the main thread may use."""
    # math-verify only for the math reward: `qurl --help` imports this package
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0


def first_number_reward(response: str, answer: str) -> float:
    """1.0 if the first number in the response equals `answer` exactly (the synthetic task's check)."""
    match = _FIRST_NUMBER.search(response)
    return 1.0 if match is not None and float(match.group()) == float(answer) else 0.0


REWARDS: dict[str, RewardFn] = {"math": math_reward, "first_number": first_number_reward}
#: a reply that states `answer` as each built-in reward reads it: the reward pays it in full
_STATED: dict[str, Callable[[str], str]] = {"math": lambda answer: f"The answer is $\\boxed{{{answer}}}$.",
                                            "first_number": lambda answer: answer}


def replies_stating(reward: str, answer: str) -> list[str]:
    """Replies that a reward named `reward` should pay for `answer` (`qurl train --check` scores the data's
    answers with them): a built-in reward's own form; for a user's, the bare answer and the answer boxed."""
    return [_STATED[reward](answer)] if reward in _STATED else [answer, f"\\boxed{{{answer}}}"]
#: `package.module:function`, the form of a user's reward
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_batched(fn: Callable) -> bool:
    """Whether `fn` scores lists of responses: its first parameter is annotated as a list. Raises ValueError
    unless `fn` takes (response, answer) (further parameters need defaults)."""
    try:
        params = inspect.signature(fn).parameters
        inspect.signature(fn).bind("", "")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} must take (response: str, answer: str), or "
                         f"(responses: list[str], answers: list[str]) batched: {err}") from None
    first = next(iter(params.values()))
    try:
        hint = typing.get_type_hints(fn).get(first.name)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve is not a list
        hint = first.annotation
    return hint is list or typing.get_origin(hint) is list


def load_reward(name: str) -> RewardFn:
    """The reward `name` names: a key of REWARDS, or `package.module:function` imported, its signature checked
    (`is_batched`). Raises ValueError naming what is wrong and the fix."""
    if name in REWARDS:
        return REWARDS[name]
    if not DOTTED.fullmatch(name):
        raise ValueError(f"{name!r} is neither one of {list(REWARDS)} nor package.module:function")
    module, _, attr = name.partition(":")
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{name}: cannot import {module} ({err}); put its package on PYTHONPATH on every node, "
                         "or install it") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed as it ran: said in one line
        raise ValueError(f"{name}: importing {module} raised {type(err).__name__}: {err}; fix the module (it runs "
                         "on import in every process that scores)") from None
    fn = getattr(imported, attr, None)
    if fn is None:
        raise ValueError(f"{name}: {module} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{name} is a {type(fn).__name__}, not a function")
    is_batched(fn)
    return fn


def _calls(fn: Callable, responses: list[str], answers: list[str]) -> list:
    """fn's result for each response, or the exception that stands for it (a batched fn's for all)."""
    batched, is_async = is_batched(fn), inspect.iscoroutinefunction(fn)

    def one(response: str, answer: str):
        try:
            return fn(response, answer)
        except Exception as err:  # noqa: BLE001 - counted by score_all
            return err

    if batched:
        try:
            out = asyncio.run(fn(responses, answers)) if is_async else fn(responses, answers)
            out = list(out)
            if len(out) != len(responses):
                raise ValueError(f"a batched reward returned {len(out)} scores for {len(responses)} responses")
        except Exception as err:  # noqa: BLE001 - counted by score_all
            out = [err] * len(responses)
        return out
    if not is_async:
        return [one(r, a) for r, a in zip(responses, answers)]

    async def every():
        return await asyncio.gather(*(fn(r, a) for r, a in zip(responses, answers)), return_exceptions=True)

    return asyncio.run(every())


@dataclass
class RewardStats:
    errors: int = 0
    messages: list[str] = field(default_factory=list)


def score_all(fn: Callable, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
    """Score every response with `fn` (any form of the module docstring); an exception (or a non-finite
    score) gives 0 and is recorded in the stats."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    scores, stats = [], RewardStats()
    for result in _calls(fn, responses, answers):
        try:
            if isinstance(result, Exception):
                raise result
            score = float(result)
            if score != score or score in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite reward {score}")
        except Exception as err:  # noqa: BLE001 - any failure of user reward code is scored, never fatal
            stats.errors += 1
            stats.messages.append(f"{type(err).__name__}: {err}")
            score = 0.0
        scores.append(score)
    return scores, stats
