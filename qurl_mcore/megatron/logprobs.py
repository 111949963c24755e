"""Per-token log-probs of given sequences from a Megatron GPTModel, and the experts each token was routed to.

  logprob[b, t] = log softmax(z[b, t-1] / T)[x[b, t]]     for t ≥ 1 inside a sequence; 0 elsewhere

with z the logits. Under TP the logits stay vocab-sharded and the log-softmax is Megatron's vocab-parallel
one (`vocab_parallel_cross_entropy`: a max and a sum all-reduced over TP, never the full vocabulary on one
rank). Batches are padded (`attention_mask`, any side) or packed (`segment_ids`: several sequences per row).
Both become one [b, 1, s, s] mask — causal and within a segment. Megatron's RoPE always uses positions
0..s-1; a segment starting at offset o sees positions shifted by o, which RoPE's relative form cancels in
every attention score, so packed and left-padded sequences give the unpacked values up to fp rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor


@dataclass
class TokenLogProbs:
    """`logprobs` [b, s] (0 where `mask` is False); `mask` [b, s]: positions with a log-prob (a token that
    follows another of its sequence); `routed_experts` [moe layers, b, s, top-k] global expert ids by
    descending router probability (MoE, if asked; -1 at padding), else None; `entropy` [b, s] the entropy of
    the tempered next-token distribution that scored position t (if asked; 0 where `mask` is False)."""

    logprobs: Tensor
    mask: Tensor
    routed_experts: Tensor | None = None
    entropy: Tensor | None = None


def segments(attention_mask: Tensor | None, segment_ids: Tensor | None, shape: torch.Size,
             device: torch.device | None = None) -> Tensor:
    """Segment ids [b, s] (≥ 0: which sequence of the row a token belongs to; -1: padding)."""
    if attention_mask is not None and segment_ids is not None:
        raise ValueError("give attention_mask (padded batch) or segment_ids (packed batch), not both")
    if segment_ids is not None:
        seg = segment_ids.long()
    elif attention_mask is not None:
        seg = torch.where(attention_mask.bool(), 0, -1)
    else:
        seg = torch.zeros(shape, dtype=torch.long, device=device)
    if seg.shape != shape:
        raise ValueError(f"mask/segment ids have shape {tuple(seg.shape)}, the tokens {tuple(shape)}")
    return seg


def attention_mask_for(seg: Tensor) -> Tensor:
    """Megatron's boolean attention mask [b, 1, s, s], True = may NOT attend: key after query, another
    segment, or padding — except that a padding query attends to itself. No row is then fully masked: a fully
    masked row has no softmax, and SDPA's cuDNN backend (torch ≥ 2.11 on H100/H200) returns NaN query
    gradients for one, which would make every padded step non-finite. A padding position's output is never
    scored (`logprobs_from_logits`) and no real token attends to it, so real tokens' values and gradients are
    unchanged."""
    s = seg.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    itself = torch.eye(s, dtype=torch.bool, device=seg.device) & (seg < 0)[:, :, None]
    return ~(causal & same | itself)[:, None]


@dataclass
class ModelInputs:
    """What a GPTModel forward takes for a batch of token ids, and the segments the log-probs need."""

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    segments: Tensor


def model_inputs(input_ids: Tensor, *, attention_mask: Tensor | None = None,
                 segment_ids: Tensor | None = None) -> ModelInputs:
    """The forward's inputs for `input_ids` [b, s], on its device (module docstring: masks, positions)."""
    b, s = input_ids.shape
    seg = segments(attention_mask, segment_ids, input_ids.shape, input_ids.device).to(input_ids.device)
    position_ids = torch.arange(s, device=input_ids.device).expand(b, s)  # RoPE ignores them (module docstring)
    return ModelInputs(input_ids, position_ids, attention_mask_for(seg), seg)


def logprobs_from_logits(model: torch.nn.Module, logits: Tensor, inputs: ModelInputs, *, temperature: float = 1.0,
                         return_entropy: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logprobs [b, s], mask [b, s], entropy [b, s] or None) from the model's logits [b, s, V or V/TP]."""
    input_ids, seg = inputs.input_ids, inputs.segments
    b = input_ids.shape[0]
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    if model.parallel_output:
        nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.t().contiguous())
        lp = -nll.t()
    else:
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    ent = None
    if return_entropy:
        if model.parallel_output and logits.shape[-1] != model.vocab_size:
            raise NotImplementedError("per-token entropy with a vocab-sharded output layer (TP > 1); "
                                      "set the entropy coefficient to 0 or use TP = 1")
        log_p = torch.log_softmax(logits, dim=-1)
        ent = -(log_p.exp() * log_p).sum(-1)
    valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    first = torch.zeros(b, 1, dtype=torch.bool, device=valid.device)
    logprobs = torch.cat([first.to(lp.dtype), torch.where(valid, lp, 0.0)], dim=1)
    mask = torch.cat([first, valid], dim=1)
    entropy = None if ent is None else torch.cat([first.to(ent.dtype), torch.where(valid, ent, 0.0)], dim=1)
    return logprobs, mask, entropy


class _RouteRecorder:
    """Forward hooks on every MoE router, recording each token's top-k experts."""

    def __init__(self, model: torch.nn.Module):
        self.routes: list[Tensor] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module, inputs, output) -> None:
        probs, routing_map = output
        scores = probs.detach().masked_fill(~routing_map, float("-inf"))
        self.routes.append(scores.topk(module.topk, dim=-1).indices)

    def gathered(self, batch: int, model: torch.nn.Module) -> Tensor:
        """[layers, b, s, k], the sequence-parallel shards gathered."""
        out = []
        for idx in self.routes:
            idx = idx.view(-1, batch, idx.shape[-1])  # tokens are [s, b] flattened
            if model.config.sequence_parallel:
                idx = gather_from_sequence_parallel_region(idx, tensor_parallel_output_grad=False)
            out.append(idx.transpose(0, 1))
        return torch.stack(out)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    temperature: float = 1.0,
    grad: bool = False,
    return_routed_experts: bool = False,
    return_entropy: bool = False,
) -> TokenLogProbs:
    """Log-probs of `input_ids` [b, s] under `model` (π_prox with grad=False, π_θ with grad=True).

    Under TP every rank passes the same batch and gets the same result; with sequence parallelism s must be
    divisible by TP. `temperature` divides the logits as the rollout engine's sampler does. `return_entropy`
    adds H_t = −Σ_v p_v log p_v of p = softmax(z[t-1]/T) (differentiable; needs the full vocabulary on one rank,
    i.e. TP = 1)."""
    inputs = model_inputs(input_ids, attention_mask=attention_mask, segment_ids=segment_ids)
    recorder = _RouteRecorder(model) if return_routed_experts else None
    try:
        with torch.set_grad_enabled(grad):
            logits = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask)  # [b, s, V or V/TP]
            logprobs, mask, entropy = logprobs_from_logits(model, logits, inputs, temperature=temperature,
                                                           return_entropy=return_entropy)
    finally:
        if recorder is not None:
            recorder.close()
    routes = None
    if recorder is not None:
        if not recorder.routes:
            raise ValueError("return_routed_experts=True but the model has no MoE router")
        routes = recorder.gathered(input_ids.shape[0], model).masked_fill((inputs.segments < 0)[None, :, :, None], -1)
    return TokenLogProbs(logprobs, mask, routes, entropy)
