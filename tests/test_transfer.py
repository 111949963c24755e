"""The neutral tensor-moving helpers shared by megatron/ and rollout/."""
from __future__ import annotations

import socket

import pytest
import torch

from qurl_mcore.transfer import buckets, comm_backend, dtype_name, free_port


def test_buckets_bound_size_keep_order_and_never_split():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    out = list(buckets(tensors, max_bytes=64))
    assert [name for b in out for name, _ in b] == [name for name, _ in tensors]
    for b in out:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 64 or len(b) == 1  # the 200-byte tensor travels alone
    assert [len(b) for b in out] == [2, 1, 1, 2]  # 20+40 | 10 | 200 | 2+2
    with pytest.raises(ValueError):
        list(buckets(tensors, 0))


def test_buckets_stream_one_bucket_at_a_time():
    """A bucket is handed on as soon as it is full: the producer is never more than one tensor ahead."""
    produced = []

    def tensors():
        for i in range(6):
            produced.append(i)
            yield f"t{i}", torch.zeros(8)  # 32 bytes each: two per 64-byte bucket

    seen = []
    for bucket in buckets(tensors(), 64):
        seen.append(len(produced))
    assert seen == [3, 5, 6]  # bucket k is yielded once tensor 2k+2 (the first that does not fit) is made


def test_free_port_is_bindable_and_backend_follows_the_device():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert comm_backend("cpu") == "gloo" and comm_backend("cuda:1") == "nccl"
    assert comm_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert dtype_name(torch.bfloat16) == dtype_name("torch.bfloat16") == dtype_name("bfloat16") == "bfloat16"
