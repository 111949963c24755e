"""From rollout samples to the trainer's tensors.

Token t of a sequence sits at position t; its log-prob (given tokens < t) is stored at position t too, the
convention of `qurl_mcore.megatron.logprobs.token_logprobs`. A response of length R after a prompt of length P
fills positions P .. P+R-1 of `response_mask` and `behav_logprobs`. Rows are right-padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Sample:
    """One generated response with what the rollout engine returned for it."""

    prompt_ids: list[int]
    response_ids: list[int]
    behav_logprobs: list[float]
    reward: float = 0.0
    group: int = 0  # the prompt it answers; GRPO/RLOO compare samples within a group
    routed_experts: Tensor | None = None  # MoE: [response tokens, layers, k] from the engine, if returned
    meta: dict = field(default_factory=dict)


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, S] long
    attention_mask: Tensor  # [B, S] bool: real tokens
    response_mask: Tensor  # [B, S] bool: response tokens (the ones the loss sees)
    behav_logprobs: Tensor  # [B, S] float32, 0 outside responses
    advantages: Tensor  # [B] float32

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: Tensor | slice) -> "TrainBatch":
        return TrainBatch(self.input_ids[index], self.attention_mask[index], self.response_mask[index],
                          self.behav_logprobs[index], self.advantages[index])

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.response_mask,
                                                   self.behav_logprobs, self.advantages)))


def collate(samples: list[Sample], advantages: Tensor, pad_id: int) -> TrainBatch:
    """Right-padded tensors for `samples`, with one advantage per sample."""
    if not samples:
        raise ValueError("no samples to train on")
    if advantages.shape != (len(samples),):
        raise ValueError(f"need one advantage per sample: {len(samples)} samples, advantages {tuple(advantages.shape)}")
    for i, s in enumerate(samples):
        if len(s.response_ids) != len(s.behav_logprobs):
            raise ValueError(f"sample {i}: {len(s.response_ids)} response tokens but {len(s.behav_logprobs)} "
                             "behaviour log-probs; ask the engine for log-probs of every generated token")
        if not s.prompt_ids:
            raise ValueError(f"sample {i} has an empty prompt")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.bool)
    response = torch.zeros(b, width, dtype=torch.bool)
    behav = torch.zeros(b, width, dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention[i, : p + r] = True
        response[i, p : p + r] = True
        behav[i, p : p + r] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
    return TrainBatch(input_ids, attention, response, behav, advantages.to(torch.float32))
