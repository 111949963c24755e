"""A generated verifiable task that needs no download: small additions, answered with just the number.

Small enough that SmolLM2-135M-Instruct is right some of the time and can learn to be right more often
within minutes of RL on a CPU; the answer check is exact, so the reward has no noise of its own.
"""
from __future__ import annotations

import random

from .datasets import Example

INSTRUCTION = "Reply with just the number."


def addition_examples(n: int, *, seed: int = 0, max_operand: int = 9) -> list[Example]:
    """`n` prompts "What is a + b? Reply with just the number." with 0 <= a, b <= max_operand."""
    if n < 1 or max_operand < 1:
        raise ValueError(f"need n >= 1 and max_operand >= 1 (got n={n}, max_operand={max_operand})")
    rng = random.Random(seed)
    return [_addition(rng, max_operand) for _ in range(n)]


def _addition(rng: random.Random, max_operand: int) -> Example:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return Example(({"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"},), str(a + b))


def held_out_additions(n: int, train: list[Example], *, seed: int = 0, max_operand: int = 9) -> list[Example]:
    """`n` distinct prompts of `addition_examples`' form and operand range that are none of the `train` prompts
    (made by `addition_examples` with the same `max_operand`): a held-out split. Raises ValueError when fewer
    than `n` such prompts exist."""
    seen = {ex.messages[-1]["content"] for ex in train}
    unseen = (max_operand + 1) ** 2 - len(seen)
    if n > unseen:
        raise ValueError(f"only {unseen} of the {(max_operand + 1) ** 2} additions with operands 0..{max_operand} "
                         f"are not training prompts, {n} held-out ones asked for; lower eval.num_prompts or "
                         "data.num_prompts, or raise data.max_operand")
    rng = random.Random(f"held-out-{seed}")  # a stream of its own: the training prompts stay as they are
    out: dict[str, Example] = {}
    while len(out) < n:
        example = _addition(rng, max_operand)
        if example.messages[-1]["content"] not in seen:
            out.setdefault(example.messages[-1]["content"], example)
    return list(out.values())
