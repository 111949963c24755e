"""Broadcast weight pushes (the disaggregated RL layout): the trainer's rank 0 shares a torch.distributed
group (NCCL on GPU, gloo on CPU) with the rollout engines and broadcasts the HF-named tensors to them, a bucket
at a time as one byte buffer (`WeightSender.send`): full-precision weights, or a code push's codes and scales
(`qurl_mcore.rollout.codes`), which the engines install with the same loaders as a tensor push's.

The group has 1 + sum(engine TP sizes) ranks: the sender is rank 0, each engine's TP ranks follow in turn.
Both sides of every step block until the other side takes part, so the calls to the engines run in threads
of the sending process while it broadcasts (the engines are HTTP or in-process clients):

  open_weight_group(engines, ...)          the sender creates the group while every engine joins it
  broadcast_weights(sender, engines, ...)  one push, streamed bucket by bucket
  close_weight_group(sender, engines)      every engine leaves, the sender destroys the group

`broadcast_weights` holds one bucket at a time: it takes a bucket from its iterable (e.g. the trainer's
`export_hf_weights`, which gathers it just then), checks its spec with every engine (`check_specs`: a bad
spec stops the push before anything of that bucket moves), hands the spec to every engine's receiving
session and broadcasts it. An engine that fails is named (`WeightPushError.engine`, and its URL in the
message); an engine that had loaded earlier buckets is tagged `incomplete:<version>` (as after any failed
push). After a failure the two sides may disagree on what has been sent: leave and re-create the group.

The group's timeout T bounds a stall on both sides: the sender's collectives fail after T (gloo/NCCL), and
once the sender is done (or failed) an engine whose call has not answered within T of its last progress
(taking the next bucket) is named as stalled, e.g. behind a link that went down: its thread is left to end
on its own, its HTTP call being bound only by the client's much longer timeout.
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from qurl_mcore.transfer import NamedTensor, comm_backend

from .engine import BucketSpec, RolloutEngine, WeightPushError, bucket_spec, wire_order

DEFAULT_GROUP = "qurl-weights"


class WeightSender:
    """Rank 0 of a weight group: broadcasts buckets of (HF name, tensor) to every engine rank."""

    def __init__(self, group, group_name: str, backend: str, world_size: int, timeout: float = 1800.0):
        self.group, self.group_name, self.backend, self.world_size = group, group_name, backend, world_size
        self.timeout = timeout  # seconds a peer may stall a collective or a push before it fails
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @classmethod
    def connect(cls, world_size: int, master_addr: str, master_port: int, group_name: str = DEFAULT_GROUP,
                backend: str | None = None, timeout: float = 1800.0) -> "WeightSender":
        """Create the group as rank 0, hosting its TCP rendezvous at master_addr:master_port (an address the
        engines reach); blocks until all `world_size` ranks joined. `timeout` (s) bounds every later
        broadcast too."""
        # SGLang only where a weight group opens: the rollout client imports without it
        from sglang.srt.utils import init_custom_process_group

        backend = backend or comm_backend()
        group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                          world_size=world_size, rank=0, group_name=group_name,
                                          timeout=datetime.timedelta(seconds=timeout))
        return cls(group, group_name, backend, world_size, timeout)

    def send(self, bucket: Iterable[NamedTensor]) -> None:
        """Broadcast one bucket as one byte buffer on the group's device: its tensors' bytes end to end in
        `wire_order`, which the engines cut back into tensors by the bucket's spec (`bucket_spec`; SGLang's
        flattened receive). One collective a bucket, whatever the tensors' dtypes: gloo moves no float8, and a
        code push's FP8 codes and E4M3 scales travel as bytes (the buffer costs the sender one bucket)."""
        tensors = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in wire_order(bucket)]
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.uint8, device=self.device)
        start = 0
        for t in tensors:
            flat[start:start + t.numel()].copy_(t)
            start += t.numel()
        torch.distributed.broadcast(flat, src=0, group=self.group)

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


def _peer(index: int, engine: RolloutEngine) -> str:
    """How errors name engine `index` of a push: with its URL when it has one (an HTTP server)."""
    url = getattr(engine, "url", None)
    return f"engine {index} at {url}" if url else f"engine {index}"


def _together(main: Callable[[], Any], others: Sequence[Callable[[], Any]], peers: Sequence[str], timeout: float,
              errors: list[BaseException | None] | None = None, since: list[float] | None = None) -> Any:
    """Run `main` here and each of `others` in a thread (the exception of `others[i]` lands in `errors[i]`
    as it happens; `since[i]`, the time.monotonic() of its last progress, it may move on). Once main has
    ended, `others[i]` has until since[i] + timeout to end. Raise the first error of the others, or the
    stall of one still running then, as WeightPushError naming `peers[i]`; else main's error."""
    errors = [None] * len(others) if errors is None else errors
    errors[:] = [None] * len(others)
    since = [time.monotonic()] * len(others) if since is None else since

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(others)]
    for t in threads:
        t.start()
    main_error: BaseException | None = None
    result = None
    try:
        result = main()
    except BaseException as e:  # noqa: BLE001 -- raised below, after the joins
        main_error = e
    for i, t in enumerate(threads):
        while t.is_alive() and (left := since[i] + timeout - time.monotonic()) > 0:
            t.join(left)
        e = errors[i]
        if t.is_alive():  # a daemon thread: it ends when its call does, and nothing waits for it
            sender = f"; the sender: {type(main_error).__name__}: {main_error}" if main_error else ""
            raise WeightPushError(f"{peers[i]}: no answer for {timeout:g} s (the broadcast timeout, "
                                  f"rollout.broadcast_timeout_s): it stalled or the link to it is down{sender}"[:2000],
                                  engine=i) from main_error
        if e is not None and e is not main_error:  # an engine's own failure, not main's handed on to it
            raise WeightPushError(f"{peers[i]}: {type(e).__name__}: {e}", engine=i) from e
    if main_error is not None:
        raise main_error
    return result


def open_weight_group(engines: Sequence[RolloutEngine], master_addr: str, master_port: int,
                      group_name: str = DEFAULT_GROUP, backend: str | None = None,
                      timeout: float = 1800.0) -> WeightSender:
    """Connect a sender and every engine (TP ranks in list order) in one group; returns the sender."""
    backend = backend or comm_backend()
    offsets = [1 + sum(e.tp_size for e in engines[:i]) for i in range(len(engines))]
    world_size = 1 + sum(e.tp_size for e in engines)
    joins = [lambda e=e, o=o: e.join_weight_group(master_addr, master_port, o, world_size, group_name, backend)
             for e, o in zip(engines, offsets)]
    return _together(lambda: WeightSender.connect(world_size, master_addr, master_port, group_name, backend,
                                                  timeout), joins, [_peer(i, e) for i, e in enumerate(engines)],
                     timeout)


def broadcast_weights(sender: WeightSender, engines: Sequence[RolloutEngine],
                      buckets: Iterable[Iterable[NamedTensor]], version: str) -> int:
    """One broadcast push of `buckets` (consumed once, one bucket at a time) into every engine as weight
    `version`: the engines receive in threads while this thread takes each bucket and broadcasts it.
    Returns the number of buckets."""
    feeds: list[queue.Queue] = [queue.Queue() for _ in engines]
    failed: list[BaseException | None] = []
    since = [time.monotonic()] * len(engines)  # engine i's last progress: it took a bucket (or the end)

    def specs_from(i: int) -> Iterator[BucketSpec]:
        while (item := feeds[i].get()) is not None:
            since[i] = time.monotonic()
            if isinstance(item, BaseException):
                raise item
            yield item
        since[i] = time.monotonic()

    def post(item) -> None:
        for feed in feeds:
            feed.put(item)

    def stream() -> int:
        count = 0
        try:
            for bucket in buckets:
                bucket = list(bucket)
                if not bucket:
                    continue
                spec = bucket_spec(bucket)
                for engine in engines:
                    engine.check_specs([spec])
                if any(e is not None for e in failed):  # the broadcast would wait for an engine that gave up
                    raise WeightPushError("an engine failed during a broadcast push; the push stops")
                post(spec)
                sender.send(bucket)
                count += 1
        except BaseException as e:
            post(e)  # the receivers end their sessions without asking for the unsent buckets
            raise
        post(None)
        return count

    return _together(stream, [lambda e=e, i=i: e.receive_weights(specs_from(i), version, sender.group_name)
                              for i, e in enumerate(engines)], [_peer(i, e) for i, e in enumerate(engines)],
                     sender.timeout, failed, since)


def close_weight_group(sender: WeightSender, engines: Sequence[RolloutEngine]) -> None:
    """Leave the group on every engine that is in it (best effort: a restarted engine never joined) and
    destroy it on the sender."""
    try:
        for engine in engines:
            try:
                engine.leave_weight_group(sender.group_name)
            except Exception:  # noqa: BLE001 - the group is being replaced anyway
                pass
    finally:
        sender.close()
