"""Rollout routing replay (R3) and routing capture in Megatron's MoE routers.

A `RouterTap` sits in each `TopKRouter` at the hook megatron-core 0.16.1 gives top-k selection
(`router.router_replay`, called by `moe_utils.topk_routing_with_score_function` with the router's scores and its
own top-k function). Per token t it computes the router's own top-k set O_t (recorded in `own`) and, when a target
is set, routes to

  E_t = R_t  where the rollout engine reported experts R_t for t (its expert ids ≥ 0),  else O_t,

with gate weights taken from the trainer's own scores over E_t: scores.gather(E_t), which Megatron then turns into
probabilities exactly as for its own choice (softmax over the selected logits when the model renormalises over
the top-k, `moe_router_pre_softmax=False`; the softmax over all experts gathered otherwise). So the gradient
reaches the router through the replayed experts' logits, as in the routing-replay literature (R3). Without a
target the tap returns Megatron's own selection untouched, so a run without replay is bitwise what it was.

Positions without rollout routing: the last token of a sequence (the engine never forwards the token it sampled
last) and padding. Their outputs feed no log-prob of the loss (causal attention; padding is masked), so the
trainer's own choice there changes nothing that is trained on.

Token order. The router sees tokens as [s, b] flattened (s-major), the local sequence shard under sequence
parallelism; targets are given per batch as [b, s, layers, k] (all layers of the model: the engine's layout) and
cut here to that order and shard. Megatron's fused router (`moe_router_fusion`) skips the hook: not supported.
"""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from qurl_mcore.rl.metrics import topk_agreement_sums


class RouterTap:
    """The top-k hook of one MoE router (module docstring): records its own choice, replays a target."""

    def __init__(self, layer_number: int):
        self.layer_number = layer_number  # global, 1-based (Megatron's TransformerLayer.layer_number)
        self.target: Tensor | None = None  # [tokens, k] long, -1 = own choice
        self.own: Tensor | None = None  # [tokens, k] the router's own top-k at the last forward

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
                        ) -> tuple[Tensor, Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = own.detach()
        if self.target is None:
            return probs, own
        if self.target.shape != own.shape:
            raise ValueError(f"routing replay of layer {self.layer_number}: target {tuple(self.target.shape)}, "
                             f"the router routes {tuple(own.shape)} (tokens, top-k)")
        chosen = torch.where(self.target >= 0, self.target.to(own.device), own)
        return scores.gather(1, chosen), chosen


class RoutingTaps:
    """The taps of every MoE router of `model` (this rank's pipeline stage), by global layer number."""

    def __init__(self, model: torch.nn.Module):
        self.taps: dict[int, RouterTap] = {}
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:
                    raise ValueError("routing capture/replay needs Megatron's unfused router; "
                                     "set moe_router_fusion=False")
                module.router_replay = self.taps.setdefault(module.layer_number, RouterTap(module.layer_number))
        self.sequence_parallel = getattr(model.config, "sequence_parallel", False)

    def __bool__(self) -> bool:
        return bool(self.taps)

    def _local(self, per_token: Tensor) -> Tensor:
        """[b, s, ...] → the router's token order [s_local · b, ...] (module docstring)."""
        x = per_token.transpose(0, 1)
        if self.sequence_parallel:
            x = x.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
        return x.reshape(-1, *x.shape[2:])

    def replay(self, experts: Tensor | None) -> None:
        """Route by `experts` [b, s, layers, k] (-1: own choice) from the next forward on; None: own routing."""
        for layer, tap in self.taps.items():
            tap.target = None if experts is None else self._local(experts[:, :, layer - 1]).long()

    def agreement(self, experts: Tensor, mask: Tensor, num_layers: int) -> Tensor:
        """Own routing of the last forward vs `experts` [b, s, layers, k] over the tokens in `mask` [b, s]:
        float64 [num_layers, 3], per global layer (tokens, tokens with the same top-k set, Σ |own ∩ rollout| / k);
        zeros for layers not on this rank. Sums, so that micro-batches and ranks add up; on the routers' device,
        with nothing read back to the host."""
        out = torch.zeros(num_layers, 3, dtype=torch.float64, device=mask.device)
        keep = self._local(mask)
        for layer, tap in self.taps.items():
            if tap.own is None:
                continue
            rollout = self._local(experts[:, :, layer - 1]).to(tap.own.device).long()
            here = keep.to(tap.own.device)
            same, overlap = topk_agreement_sums(tap.own[:, None], rollout[:, None], here)
            out = out.to(tap.own.device)
            out[layer - 1] = torch.cat([here.sum().double().reshape(1), same, overlap])
        return out
