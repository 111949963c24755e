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
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Example(({"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"},), str(a + b)))
    return out
