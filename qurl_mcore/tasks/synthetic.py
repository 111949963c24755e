"""A generated verifiable task that needs no download: small additions, answered with just the number.

Small enough that SmolLM2-135M-Instruct is right some of the time and can learn to be right more often
within minutes of RL on a CPU; the answer check is exact, so the reward has no noise of its own.
"""
from __future__ import annotations

import random

from .datasets import Example

INSTRUCTION = "Reply with just the number."


def addition_examples(n: int, *, seed: int = 0, min_operand: int = 0, max_operand: int = 9) -> list[Example]:
    """`n` prompts "What is a + b? Reply with just the number." with min_operand <= a, b <= max_operand.

    With a zero operand the other operand is the sum, so under the `first_number` reward a policy that names
    the other operand first ("To add 7 to ..." for 0 + 7) is paid for not adding; min_operand 1 leaves it
    nothing."""
    if n < 1 or not 0 <= min_operand < max_operand:
        raise ValueError(f"need data.num_prompts >= 1 and 0 <= data.min_operand < data.max_operand (got {n}, "
                         f"{min_operand}, {max_operand})")
    rng = random.Random(seed)
    return [_addition(rng, min_operand, max_operand) for _ in range(n)]


def _addition(rng: random.Random, lo: int, hi: int) -> Example:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return Example(({"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"},), str(a + b))


def held_out_additions(n: int, train: list[Example], *, seed: int = 0, min_operand: int = 0,
                       max_operand: int = 9) -> list[Example]:
    """`n` distinct prompts of `addition_examples`' form and operand range that are none of the `train` prompts
    (made by `addition_examples` with the same operand range): a held-out split. Raises ValueError when fewer
    than `n` such prompts exist."""
    seen = {ex.messages[-1]["content"] for ex in train}
    total = (max_operand - min_operand + 1) ** 2
    if n > total - len(seen):
        raise ValueError(f"only {total - len(seen)} of the {total} additions with operands "
                         f"{min_operand}..{max_operand} are not training prompts, {n} held-out ones asked for; "
                         "lower eval.num_prompts or data.num_prompts, or widen data.min_operand..data.max_operand")
    rng = random.Random(f"held-out-{seed}")  # a stream of its own: the training prompts stay as they are
    out: dict[str, Example] = {}
    while len(out) < n:
        example = _addition(rng, min_operand, max_operand)
        if example.messages[-1]["content"] not in seen:
            out.setdefault(example.messages[-1]["content"], example)
    return list(out.values())
