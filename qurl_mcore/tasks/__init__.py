"""Prompts with verifiable answers, and the rewards that check them (pure Python; no model code)."""
from .datasets import Example, load_examples
from .rewards import REWARDS, RewardStats, math_reward, score_all
from .synthetic import addition_examples

__all__ = ["Example", "REWARDS", "RewardStats", "addition_examples", "load_examples", "math_reward", "score_all"]
