"""The neutral tensor-moving helpers shared by megatron/ and rollout/."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from qurl_mcore.transfer import PACK_ALIGN, buckets, comm_backend, dtype_name, free_port, packed


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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_packed_tensors_are_the_same_values_in_one_shared_buffer_sent_as_one_handle(monkeypatch):
    """Every dtype a code push sends (0-dim included) keeps its name, dtype, shape and bytes, aligned in one
    storage in shared memory; pickled for another process, the bucket passes one file descriptor, where its
    tensors apart pass one each."""
    import multiprocessing.reduction

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    gen = torch.Generator().manual_seed(0)
    tensors = [("codes", torch.randint(-127, 128, (5, 7), dtype=torch.int8, generator=gen)),
               ("fp8", torch.randn(3, 5, generator=gen).to(torch.float8_e4m3fn)),
               ("scale", torch.rand(5, 1, generator=gen)), ("global", torch.tensor(0.25)),
               ("fp4", torch.randint(0, 256, (3, 9), dtype=torch.uint8, generator=gen)),
               ("norm", torch.randn(11, generator=gen).to(torch.bfloat16))]
    out = packed(tensors)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, t), (_, p) in zip(tensors, out):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(_bytes(p), _bytes(t))
        assert p.is_contiguous() and p.storage_offset() * p.element_size() % PACK_ALIGN == 0
    assert len({p.untyped_storage().data_ptr() for _, p in out}) == 1 and out[0][1].is_shared()
    assert packed([]) == []

    passed = []
    dup = multiprocessing.reduction.DupFd
    monkeypatch.setattr(multiprocessing.reduction, "DupFd", lambda fd: passed.append(fd) or dup(fd))
    multiprocessing.reduction.ForkingPickler.dumps(out)
    assert len(passed) == 1
    multiprocessing.reduction.ForkingPickler.dumps([(n, t.clone()) for n, t in tensors])
    assert len(passed) == 1 + len(tensors)


def test_a_host_buffer_is_reused_only_once_its_bucket_is_gone():
    """`packed` on the host takes a shared buffer of an earlier bucket once none of that bucket's tensors is
    left (no new pages to touch), and a new one while they live, so a bucket still held keeps its values."""
    from qurl_mcore.transfer import HostBuffers

    pool = HostBuffers()
    first = pool.take(1000)
    view = first[10:20]
    del first
    second = pool.take(500)  # the first buffer's view still lives: a new buffer
    assert second.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    ptr = view.untyped_storage().data_ptr()
    del view
    assert pool.take(800).untyped_storage().data_ptr() == ptr  # unused now, and it fits
    assert len(pool._buffers) == 2
    del second
    pool.take(4000)  # neither fits: both are freed for a new one
    assert len(pool._buffers) == 1


def test_free_port_is_bindable_and_backend_follows_the_device():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert comm_backend("cpu") == "gloo" and comm_backend("cuda:1") == "nccl"
    assert comm_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert dtype_name(torch.bfloat16) == dtype_name("torch.bfloat16") == dtype_name("bfloat16") == "bfloat16"


def test_gloo_of_a_local_group_binds_loopback(monkeypatch):
    """Gloo would listen where the host name resolves, on many hosts the external interface: a group whose
    rendezvous is loopback gets the loopback interface."""
    import psutil

    from qurl_mcore.transfer import bind_gloo_towards

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    name = bind_gloo_towards("127.0.0.1")
    assert name is not None and os.environ["GLOO_SOCKET_IFNAME"] == name
    assert "127.0.0.1" in {a.address for a in psutil.net_if_addrs()[name]}


def test_gloo_follows_each_peer_but_never_overrides_the_users_choice(monkeypatch):
    """The interface chosen for one group is chosen again for the next group's peer (not first-wins); one the
    user set stays."""
    import psutil

    from qurl_mcore import transfer

    outside = [(name, a.address) for name, addresses in psutil.net_if_addrs().items() for a in addresses
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not outside:
        pytest.skip("this host has no IPv4 address beyond loopback")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(transfer, "_GLOO_CHOSEN", [None])
    loopback = transfer.bind_gloo_towards("127.0.0.1")
    assert transfer.bind_gloo_towards(outside[0][1]) == outside[0][0] != loopback
    assert os.environ["GLOO_SOCKET_IFNAME"] == outside[0][0]
    assert transfer.bind_gloo_towards("127.0.0.1") == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    assert transfer.bind_gloo_towards(outside[0][1]) is None and os.environ["GLOO_SOCKET_IFNAME"] == "mine"


def test_a_stores_binding_ends_with_its_scope():
    import importlib

    from qurl_mcore.transfer import stores_bound_to_their_address

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = rendezvous._create_c10d_store
    with stores_bound_to_their_address():
        assert rendezvous._create_c10d_store is not original
    assert rendezvous._create_c10d_store is original


def test_gloo_binds_the_interface_towards_the_rendezvous(netns_nodes, monkeypatch):
    """On a host whose name resolves to a loopback address (as on Debian, or in these namespace nodes), gloo
    would advertise it to the other nodes; towards another node's address the interface that reaches it is
    chosen; when the user set one, nothing changes."""
    import subprocess
    import sys

    from qurl_mcore.transfer import bind_gloo_towards

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    assert bind_gloo_towards("10.0.0.1") is None and os.environ["GLOO_SOCKET_IFNAME"] == "mine"
    nodes = netns_nodes(2)
    probe = ("import os, sys; from qurl_mcore.transfer import bind_gloo_towards; "
             "print(bind_gloo_towards(sys.argv[1]), os.environ.get('GLOO_SOCKET_IFNAME'))")
    env = {k: v for k, v in nodes.env.items() if k != "GLOO_SOCKET_IFNAME"}
    out = subprocess.run(nodes.command(1, sys.executable, "-c", probe, nodes.addr(2)), env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["eth0", "eth0"], out.stderr
