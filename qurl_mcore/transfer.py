"""Moving tensors between processes: what the trainer (megatron/) and the rollout client (rollout/) share.

  buckets        split a stream of (name, tensor) into groups of bounded bytes
  packed         a group's tensors as views of one buffer: one handle to send instead of one per tensor
  free_port      a TCP port for a rendezvous or a server
  comm_backend   the torch.distributed backend of a device: NCCL on CUDA, gloo otherwise
  dtype_name     "bfloat16" for torch.bfloat16 (the name SGLang's update calls take)
  stores_bound_to_their_address  torch.distributed rendezvous stores listen only where they are reached
  bind_gloo_towards  gloo connects through the interface that reaches a group's rendezvous
"""
from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import os
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


#: byte alignment of each tensor in a `packed` buffer (every dtype's element size divides it)
PACK_ALIGN = 64


class HostBuffers:
    """Buffers in shared host memory that `packed` hands out again once nothing else holds them. Most of the
    time of a pack into new shared memory is its first touch of each 4 KiB page (a page fault and a zeroed page:
    for 100 MiB about 10x the copy into a buffer used before, on a 2-core host). A buffer is reused when the
    tensors of its last bucket are all gone (sent, and dropped by the consumer); unused buffers too small for the
    bucket asked for are freed. So the buffers held are about those of the buckets alive at once (a push's
    bucket being filled and the one being sent), each at most the largest bucket."""

    def __init__(self):
        self._buffers: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least `nbytes` over a shared storage that no tensor but this pool's uses."""
        free = [b for b in self._buffers if _unused(b)]
        fits = [b for b in free if b.nbytes() >= nbytes]
        if fits:
            storage = min(fits, key=lambda b: b.nbytes())
        else:  # the unused ones are all too small: freed for a new one
            self._buffers = [b for b in self._buffers if all(b is not f for f in free)]
            storage = torch.UntypedStorage._new_shared(nbytes)
            self._buffers.append(storage)
        return torch.empty(0, dtype=torch.uint8).set_(storage)


def _unused(storage: torch.UntypedStorage) -> bool:
    """Whether nothing but the Python storage object itself refers to `storage` (no tensor over it)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


#: the host buffers of this process's `packed` buckets
_HOST_BUFFERS = HostBuffers()


def packed(named_tensors: list[NamedTensor]) -> list[NamedTensor]:
    """The same named tensors (dtypes, shapes, values) copied into one buffer, as contiguous views of it, each at
    a multiple of PACK_ALIGN bytes; all on one device. Sending tensors to another process costs a handle per
    storage (a file descriptor passed over a socket, a CUDA IPC handle), which for hundreds of small tensors
    costs more than their bytes: views of one storage cost one. On the host the buffer is in shared memory, so
    sending it copies nothing more, and it is one that an earlier bucket no longer uses where there is one
    (`HostBuffers`); on a GPU torch's caching allocator reuses memory alike."""
    if not named_tensors:
        return []
    device = named_tensors[0][1].device
    offsets, total = [], 0
    for _, t in named_tensors:
        if t.device != device:
            raise ValueError(f"packed: tensors on {device} and {t.device}; pack each device's tensors apart")
        offsets.append(total)
        total += -(-nbytes(t) // PACK_ALIGN) * PACK_ALIGN
    if device.type == "cpu":
        buffer = _HOST_BUFFERS.take(total)
    else:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    out = []
    for (name, t), start in zip(named_tensors, offsets):
        view = buffer[start:start + nbytes(t)].view(t.dtype).view(t.shape)
        out.append((name, view.copy_(t)))
    return out


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


@contextlib.contextmanager
def stores_bound_to_their_address():
    """For the duration: the TCPStore that rank 0 of a torch.distributed rendezvous hosts listens on the
    address the other ranks reach it at (127.0.0.1 for a local group, the node's interface for a group across
    nodes) instead of on every interface, which is torch's default; afterwards c10d's own store factory is
    back. A rendezvous inside it opens nothing beyond the address it names."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package shadows it by a function
    original = rendezvous._create_c10d_store
    rendezvous._create_c10d_store = functools.partial(_store_bound_to_its_address, original)
    try:
        yield
    finally:
        rendezvous._create_c10d_store = original


def bind_stores_to_their_address() -> None:
    """`stores_bound_to_their_address` for the rest of this process: for the processes whose every group is
    the run's (a trainer rank, and through the SGLang plugin every engine process). Idempotent."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if not isinstance(rendezvous._create_c10d_store, functools.partial):
        rendezvous._create_c10d_store = functools.partial(_store_bound_to_its_address, rendezvous._create_c10d_store)


def _store_bound_to_its_address(original, hostname, port, rank, world_size, timeout, use_libuv=True):
    """c10d's `_create_c10d_store`, except that rank 0's store listens on `hostname`'s address alone."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if rank != 0 or rendezvous._torchelastic_use_agent_store() or not use_libuv:
        return original(hostname, port, rank, world_size, timeout, use_libuv)
    family, kind, proto, _, address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno != errno.EADDRINUSE:
            raise
        # this process already serves a store there (torch's stores are multi-tenant): torch reuses it
        return original(hostname, port, rank, world_size, timeout, use_libuv)
    sock.listen(socket.SOMAXCONN)
    return torch.distributed.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                                      timeout=timeout, multi_tenant=True, use_libuv=True,
                                      master_listen_fd=sock.detach())  # the store owns the socket now


_GLOO_CHOSEN: list[str | None] = [None]  # the GLOO_SOCKET_IFNAME bind_gloo_towards set last in this process


def bind_gloo_towards(peer: str) -> str | None:
    """Make this process's gloo groups (torch.distributed's CPU backend, here and in the processes it starts)
    use the network interface that routes to `peer`, a group's rendezvous address, by setting
    GLOO_SOCKET_IFNAME. Gloo otherwise listens on the address its host name resolves to: on many hosts
    (Debian's 127.0.1.1, containers, network namespaces) a loopback no other node reaches, so every group
    across nodes fails to connect; on others the external interface, so a local group (a loopback `peer`)
    would be reachable from the network. Returns the interface; None (nothing changed) when
    GLOO_SOCKET_IFNAME was set by anyone but this function in this process (the user's choice, or the one
    the process that started this one made). A choice of its own it makes again for each peer."""
    if os.environ.get("GLOO_SOCKET_IFNAME", _GLOO_CHOSEN[0]) != _GLOO_CHOSEN[0]:
        return None
    # psutil: SGLang's requirement, not qurl-mcore's; only this choice of interface uses it
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))  # no packet is sent: the kernel only picks the route and its source address
        local = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = _GLOO_CHOSEN[0] = name
            return name
    raise RuntimeError(f"no network interface holds {local}, this host's address towards {peer}; set "
                       "GLOO_SOCKET_IFNAME to the interface the other nodes reach this one through")
