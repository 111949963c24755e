"""Prompts with verifiable answers, and the rewards that check them (pure Python; no model code)."""
from .datasets import Example, chat_ids, load_examples, prompt_file_problem, scan_examples
from .rewards import DOTTED, REWARDS, RewardStats, load_reward, math_reward, replies_stating, score_all
from .synthetic import addition_examples

__all__ = ["DOTTED", "Example", "REWARDS", "RewardStats", "addition_examples", "chat_ids", "load_examples",
           "load_reward", "math_reward", "prompt_file_problem", "replies_stating",
           "scan_examples", "score_all"]
