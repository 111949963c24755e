"""Prompts with verifiable answers, and the rewards that check them (pure Python; no model code)."""
from .datasets import Example, load_examples
from .rewards import DOTTED, REWARDS, RewardStats, load_reward, math_reward, score_all
from .synthetic import addition_examples

__all__ = ["DOTTED", "Example", "REWARDS", "RewardStats", "addition_examples", "load_examples", "load_reward",
           "math_reward", "score_all"]
