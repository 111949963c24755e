"""From rollout samples to the trainer's tensors.

Token t of a sequence sits at position t; its log-prob (given tokens < t) is stored at position t too, the
convention of `qurl_mcore.megatron.logprobs.token_logprobs`. A response of length R after a prompt of length P
fills positions P .. P+R-1 of `response_mask` and `behav_logprobs`. Rows are right-padded. An MoE engine's
routing of the tokens it forwarded (positions 0 .. P+R-2) fills `routed_experts` there; -1 elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

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
    routed_experts: Any = None  # MoE: [P + R - 1 forwarded tokens, layers, k] expert ids from the engine
    meta: dict = field(default_factory=dict)


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, S] long
    attention_mask: Tensor  # [B, S] bool: real tokens
    response_mask: Tensor  # [B, S] bool: response tokens (the ones the loss sees)
    behav_logprobs: Tensor  # [B, S] float32, 0 outside responses
    advantages: Tensor  # [B] float32
    routed_experts: Tensor | None = None  # MoE: [B, S, layers, k] int16 expert ids from the engine, -1 where none

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> "TrainBatch":
        return TrainBatch(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)})

    def select(self, index: Tensor | slice) -> "TrainBatch":
        return self._map(lambda t: t[index])

    def to(self, device: torch.device) -> "TrainBatch":
        return self._map(lambda t: t.to(device))


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
    routed = _routing(samples, width)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention[i, : p + r] = True
        response[i, p : p + r] = True
        behav[i, p : p + r] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
    return TrainBatch(input_ids, attention, response, behav, advantages.to(torch.float32), routed)


def _routing(samples: list[Sample], width: int) -> Tensor | None:
    """[B, width, layers, k] int16 routed experts (module docstring), or None unless every sample has them."""
    if any(s.routed_experts is None for s in samples):
        return None
    first = torch.as_tensor(samples[0].routed_experts)
    out = torch.full((len(samples), width, *first.shape[1:]), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        rows = torch.as_tensor(s.routed_experts)
        forwarded = len(s.prompt_ids) + len(s.response_ids) - 1
        if rows.shape != (forwarded, *first.shape[1:]):
            raise ValueError(f"sample {i}: routed experts {tuple(rows.shape)} for {forwarded} forwarded tokens; "
                             f"expected {(forwarded, *first.shape[1:])}")
        out[i, :forwarded] = rows.to(torch.int16)  # expert ids < 32768
    return out
