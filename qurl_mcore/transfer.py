"""Moving tensors between processes: what the trainer (megatron/) and the rollout client (rollout/) share.

  buckets        split a stream of (name, tensor) into groups of bounded bytes
  free_port      a TCP port for a rendezvous or a server
  comm_backend   the torch.distributed backend of a device: NCCL on CUDA, gloo otherwise
  dtype_name     "bfloat16" for torch.bfloat16 (the name SGLang's update calls take)
"""
from __future__ import annotations

import socket
from typing import Any, Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(named_tensors: Iterable[NamedTensor], max_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups of at most `max_bytes` each, in the given order, each yielded as soon as it is
    full (so a consumer holds one bucket at a time); a tensor larger than the bound travels alone (tensors
    are never split: SGLang's loaders take whole checkpoint tensors)."""
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        n = nbytes(tensor)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def comm_backend(device: str | torch.device | None = None) -> str:
    """NCCL for CUDA devices (default: CUDA when present), gloo for the CPU."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def dtype_name(dtype: Any) -> str:
    """"bfloat16" for torch.bfloat16, "torch.bfloat16" or "bfloat16"."""
    return str(dtype).removeprefix("torch.")
