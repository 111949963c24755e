"""Device-side stand-ins for two Megatron-Core functions that read device values back to the host where nothing
needs them there. Each keeps its Megatron function's contract and numbers; `install` puts them where Megatron
calls them.

- `multi_tensor_l2_norm`, for Megatron's `local_multi_tensor_l2_norm`, the gradient norm's kernel when neither
  Transformer Engine nor apex provides one (`qurl_mcore.stack.grad_norm`). Megatron's fallback builds
  `torch.tensor([...])` from every tensor's norm, which reads each norm back to the host; here

      ‖g‖₂ = ‖(‖g₁‖₂, …, ‖gₙ‖₂)‖₂

  stays on the device (`torch._foreach_norm`, then the norm of the stacked norms, in the dtype the norms
  promote to, as Megatron's `torch.tensor` of them gives).
- `permute`, for Megatron's unfused token permutation (`moe_utils.permute`, fused=False). Dropless routing
  sends every token to exactly top-k experts, so the number of routed tokens is known on the host
  (`num_out_tokens` = tokens · top-k, which Megatron's dispatcher passes as a Python int); Megatron's
  `masked_select` sizes its outputs from the routing map's values instead (two host reads a layer). Here
  `nonzero_static` of the expert-major routing map, with that size, gives the same (expert, token) pairs in
  the same order, so the permuted tokens, probabilities and indices are Megatron's, element for element.
  Capacity dropping, router padding and Transformer Engine's fused permute keep Megatron's own code.
"""
from __future__ import annotations

from typing import Optional

import torch

from qurl_mcore.stack import Stack, grad_norm


def multi_tensor_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                         per_tensor: bool, *args) -> tuple[torch.Tensor, None]:
    """(‖all tensors of `tensor_lists`‖₂ as a [1] float32 tensor on their device, None): the contract of
    Megatron's `local_multi_tensor_l2_norm` (no per-tensor norms), with nothing read back to the host."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors))
    return torch.norm(norms).to(torch.float32).reshape(1), None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False):
    """Megatron's `moe_utils.permute` (same arguments, same (permuted tokens, permuted probs, token indices)),
    sized by `num_out_tokens` where an unfused permutation without capacity padding gets it as a host int: the
    routing map's number of nonzeros, as Megatron's fused permutation takes it too (module docstring)."""
    from megatron.core.transformer.moe import moe_utils

    if fused or drop_and_pad or not isinstance(num_out_tokens, int):
        return moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                 drop_and_pad=drop_and_pad)
    num_tokens = routing_map.shape[0]
    # the routing map's nonzeros in [experts, tokens] order: masked_select's order over routing_map.T
    flat = torch.nonzero_static(routing_map.bool().T.reshape(-1), size=num_out_tokens).squeeze(1)
    sorted_indices = flat % num_tokens
    permuted_probs = None if probs is None else probs.T.contiguous().view(-1).index_select(0, flat)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def install(stack: Stack) -> tuple[str, ...]:
    """Put the stand-ins where Megatron calls them: `permute` in the token dispatchers, and
    `multi_tensor_l2_norm` as the gradient norm's kernel where `stack` has no other (`stack.grad_norm`).
    Returns the names of the functions installed."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    token_dispatcher.permute = permute
    installed = ["permute"]
    if grad_norm(stack)[0] == "foreach":
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
        installed.append("multi_tensor_l2_norm")
    return tuple(installed)
