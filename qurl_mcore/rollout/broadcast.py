"""Broadcast weight pushes, the disaggregated RL layout: the trainer's rank 0 shares a torch.distributed
group (NCCL on GPU, gloo on CPU) with the rollout engines and broadcasts the HF-named tensors to them.

The group has 1 + sum(engine TP sizes) ranks: the sender is rank 0, each engine's TP ranks follow in turn.
Both sides of every step block until the other side takes part, so they must run at the same time (threads
of one process, as the helpers here do, or separate processes / Ray actors):

  setup     WeightSender.connect(...)         with  engine.join_weight_group(...) for every engine
  per push  WeightSender.send(buckets)        with  engine.receive_weights(specs, version, group_name)
  teardown  WeightSender.close()              and   engine.leave_weight_group(group_name)

`open_weight_group`, `broadcast_weights` and `close_weight_group` run those pairs for a list of engines from
the trainer's rank 0 (the loop drives HTTP engines that way). `broadcast_weights` streams: it holds at most
two buckets, and checks every bucket's spec with every engine (`RolloutEngine.check_specs`) before
broadcasting it, so a bad spec stops both sides at the same bucket and the group stays usable; an engine
that had loaded earlier buckets is tagged `incomplete:<version>` (as after any failed push). After any other
failure (an engine refusing a call, a transport error) the two sides may disagree on what has been sent:
leave and re-create the group.

When driving the two sides by hand, pass `receive_weights` a list of specs: it is validated whole before
anything is received, so check it (or let `receive_weights` fail) before starting `send`, which otherwise
waits for receivers that never come, up to the group's timeout.
"""
from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .buckets import NamedTensor
from .engine import BucketSpec, RolloutEngine, WeightPushError

DEFAULT_GROUP = "qurl-weights"


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def bucket_spec(bucket: Iterable[NamedTensor]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of each tensor, the receiving side's `update_weights_from_distributed` args."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]


class WeightSender:
    """Rank 0 of a weight group: broadcasts buckets of (HF name, tensor) to every engine rank."""

    def __init__(self, group, group_name: str, backend: str, world_size: int):
        self.group, self.group_name, self.backend, self.world_size = group, group_name, backend, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @classmethod
    def connect(cls, world_size: int, master_addr: str, master_port: int, group_name: str = DEFAULT_GROUP,
                backend: str | None = None, timeout: float = 1800.0) -> "WeightSender":
        """Create the group as rank 0, hosting its TCP rendezvous at master_addr:master_port (an address the
        engines reach); blocks until all `world_size` ranks joined. `timeout` (s) bounds every later
        broadcast too."""
        from sglang.srt.utils import init_custom_process_group

        backend = backend or default_backend()
        group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                          world_size=world_size, rank=0, group_name=group_name,
                                          timeout=datetime.timedelta(seconds=timeout))
        return cls(group, group_name, backend, world_size)

    @staticmethod
    def specs(buckets: Iterable[Iterable[NamedTensor]]) -> list[list[tuple[str, str, list[int]]]]:
        """The per-bucket specs an engine's `receive_weights` takes for `send(buckets)` of the same buckets."""
        return [bucket_spec(bucket) for bucket in buckets]

    def send(self, buckets: Iterable[Iterable[NamedTensor]]) -> int:
        """Broadcast every tensor of every bucket, in order (one bucket in flight). Returns the number of
        non-empty buckets, which is the number of `update_weights_from_distributed` calls it answers."""
        count = 0
        for bucket in buckets:
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            for work in [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]:
                work.wait()
            count += bool(tensors)
        return count

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _together(main: Callable[[], Any], others: Sequence[Callable[[], Any]],
              errors: list[BaseException | None] | None = None) -> Any:
    """Run `main` here and each of `others` in a thread (their exceptions land in `errors` as they happen);
    join all and raise the first error of the others, else main's."""
    errors = [None] * len(others) if errors is None else errors
    errors[:] = [None] * len(others)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(others)]
    for t in threads:
        t.start()
    try:
        result = main()
    except BaseException as e:  # noqa: BLE001 -- raised below, after the joins
        errors.append(e)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return result


def open_weight_group(engines: Sequence[RolloutEngine], master_addr: str, master_port: int,
                      group_name: str = DEFAULT_GROUP, backend: str | None = None,
                      timeout: float = 1800.0) -> WeightSender:
    """Connect a sender and every engine (TP ranks in list order) in one group; returns the sender."""
    backend = backend or default_backend()
    offsets = [1 + sum(e.tp_size for e in engines[:i]) for i in range(len(engines))]
    world_size = 1 + sum(e.tp_size for e in engines)
    joins = [lambda e=e, o=o: e.join_weight_group(master_addr, master_port, o, world_size, group_name, backend)
             for e, o in zip(engines, offsets)]
    return _together(lambda: WeightSender.connect(world_size, master_addr, master_port, group_name, backend,
                                                  timeout), joins)


def broadcast_weights(sender: WeightSender, engines: Sequence[RolloutEngine],
                      buckets: Iterable[Iterable[NamedTensor]], version: str) -> int:
    """One broadcast push of `buckets` (e.g. `megatron.convert.export_hf_weights(...)`, consumed once) into
    every engine as weight `version`: the engines receive in threads while this thread iterates the buckets
    and broadcasts them. Returns the number of buckets."""
    feeds: list[queue.Queue] = [queue.Queue() for _ in engines]
    failed: list[BaseException | None] = []

    def specs_from(feed: queue.Queue) -> Iterator[BucketSpec]:
        while (item := feed.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def post(item) -> None:
        for feed in feeds:
            feed.put(item)

    def stream() -> int:
        # a receiver asks for bucket i only once it holds spec i + 1 (the last bucket flushes the cache), so
        # spec i + 1 is posted before bucket i is broadcast
        pending, count = None, 0
        try:
            for bucket in buckets:
                bucket = [(name, t) for name, t in bucket]
                if not bucket:
                    continue
                spec = bucket_spec(bucket)
                for engine in engines:
                    engine.check_specs([spec])
                post(spec)
                if pending is not None:
                    _stop_if_failed(failed)
                    count += sender.send([pending])
                pending = bucket
        except BaseException as e:
            post(e)  # the receivers end their sessions without asking for the unsent buckets
            raise
        post(None)
        if pending is not None:
            _stop_if_failed(failed)
            count += sender.send([pending])
        return count

    return _together(stream, [lambda e=e, f=f: e.receive_weights(specs_from(f), version, sender.group_name)
                              for e, f in zip(engines, feeds)], failed)


def _stop_if_failed(errors: list[BaseException | None]) -> None:
    """Do not broadcast to engines that already gave up (the broadcast would wait for its timeout)."""
    if any(e is not None for e in errors):
        raise WeightPushError("an engine failed during a broadcast push; the push stops")


def close_weight_group(sender: WeightSender, engines: Sequence[RolloutEngine]) -> None:
    """Leave the group on every engine and destroy it on the sender."""
    try:
        for engine in engines:
            engine.leave_weight_group(sender.group_name)
    finally:
        sender.close()
