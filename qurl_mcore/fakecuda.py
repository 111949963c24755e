"""A CUDA façade for tracing GPU code on a machine without one: `fake_cuda(devices=N)`, in a process started by
`run_traced`.

Inside the context every tensor is a fake tensor (torch's `FakeTensorMode`): it has a shape, a dtype and a
device, and no data; allocating on `cuda` costs nothing and works on the CPU build of torch. `torch.cuda`
answers for N devices of a chosen GPU (`GPUS`: capability, memory) and `torch.version.cuda` is `CUDA_VERSION`,
so SGLang (imported inside the context) and Megatron take the branches they take on that GPU; torch.distributed
runs the `cuda:fake` backend over a `FakeStore`: this process is rank `rank` of a group of `world_size` ranks
that exist only in the group, and every collective returns at once. Megatron's gloo groups (for CPU tensors)
get the `fake` backend, which takes CPU tensors: ProcessGroupGloo cannot start over a FakeStore (c10d's
init.cpp asserts "Not implemented" on the store's methods it calls).

A CPU build of torch has no CUDA device guard and no CUDA hooks, which indexing, `copy_`, `.to`, `device=<int>`
and autograd's streams ask for. `runtime_library()` compiles a small shim (c10's own `FakeGuardImpl` for CUDA,
and CUDA hooks that report CUDA as built, up to 8 devices, never initialising anything); it must load before
torch does, so traces run in a fresh process with it preloaded (`run_traced`), which also keeps the façade
away from processes where megatron/cpu_compat.py gave megatron's modules a `torch` of the CPU.

What it catches, as a GPU would:
- a CPU tensor meeting a CUDA one in an operation (`FakeTensorDeviceMismatchError`; 0-dim CPU scalars are
  allowed, as on a GPU);
- a collective on an NCCL group that ProcessGroupNCCL would refuse (`NcclError`: a tensor not on the rank's
  own device, a dtype NCCL does not move or reduce, sizes that break the collective's contract), and, over
  ranks traced one by one, collectives that differ between them (`mismatched_collectives`);
- dtypes and shapes of every operation (object collectives give every rank this rank's objects), and the bytes
  of CUDA tensors alive at once (`Trace.peak_bytes`): a `TorchDispatchMode` under the fake mode sees every
  operation's outputs, counts each CUDA storage once (views cost nothing) from the operation that first
  returns it, and holds a weak reference to it, so that a storage counts until torch frees it. The caching
  allocator's rounding and fragmentation are not modelled. `scaled_dot_product_attention` on a fake CUDA
  device runs as the memory-efficient kernel a GPU picks for a masked attention (it keeps the output and the
  log-sum-exp, not the probabilities);
- the host synchronizations the code makes (`Trace.host_syncs`, `Trace.sync_sites`).

What it cannot: whether a kernel exists for the device and dtype (a CPU build has none to ask), numerics
(there are no values: a data-dependent read answers from a value model, `_Tracer`: finiteness checks pass,
routing is balanced, a mask of unknown values selects every element, an unknown number is 1), speed, and
hangs across ranks that are not traced.

Never on a real run's path: tests and `qurl plan --trace` use it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import math
import os
import pickle
import subprocess
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (FakeTensor, FakeTensorMode, UnsupportedOperatorException,
                                           unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from qurl_mcore.models import cache_dir


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_bytes: int
    multi_processor_count: int


#: the GPUs a trace can pretend to be (torch.cuda.get_device_properties answers)
GPUS: dict[str, Gpu] = {gpu.name: gpu for gpu in (
    Gpu("A100-80GB", (8, 0), 80 << 30, 108),
    Gpu("H100-80GB", (9, 0), 80 << 30, 132),
    Gpu("H200", (9, 0), 141 << 30, 132),
    Gpu("B200", (10, 0), 180 << 30, 148),
)}
#: the shim's device guard (c10's FakeGuardImpl) knows this many devices
MAX_DEVICES = 8
#: `torch.version.cuda` inside the context: the first CUDA release that builds for every GPU of `GPUS` (SM100
#: needs 12.8), so version-gated branches (SGLang's `is_sm100_supported`: SM100 and CUDA >= 12.8) are taken
CUDA_VERSION = "12.8"


@dataclass
class Trace:
    """Bytes of fake CUDA tensors alive during a `fake_cuda` context (per storage)."""
    live_bytes: int = 0
    peak_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)  # on NCCL groups, in the order issued
    host_syncs: int = 0  # device-to-host synchronizations (`_Tracer` says which count)
    sync_sites: Counter = field(default_factory=Counter)  # "what at file:line" -> how many
    _storages: dict[int, tuple[int, int]] = field(default_factory=dict)  # storage id -> (weak ref, bytes)

    def reset_peak(self) -> None:
        self._prune()
        self.peak_bytes = self.live_bytes

    def sync(self, what: str) -> None:
        """Count a host synchronization, and where the code outside torch and this module asked for it."""
        self.host_syncs += 1
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == __file__ or
                                     f"{os.sep}torch{os.sep}" in frame.f_code.co_filename):
            frame = frame.f_back
        where = "?" if frame is None else f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        self.sync_sites[f"{what} at {where}"] += 1

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata in self._storages:
            return
        self._storages[storage._cdata] = (storage._weak_ref(), storage.nbytes())
        self.live_bytes += storage.nbytes()
        if self.live_bytes > self.peak_bytes:  # only then does the exact live total matter
            self._prune()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _prune(self) -> None:
        for key, (ref, nbytes) in list(self._storages.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._storages[key]
                self.live_bytes -= nbytes


@dataclass(frozen=True)
class Fill:
    """What a data-dependent read of a fake tensor answers: every element is `value` at a fraction `density` of
    its positions, spread evenly over every row and column (element p of the flattened tensor is `value` where
    ⌊(p+1)·density⌋ > ⌊p·density⌋), and 0 elsewhere."""
    value: float
    density: float = 1.0

    def nonzero(self) -> float:
        """The fraction of elements that are not 0."""
        return self.density if self.value else 0.0

    def real(self, shape, dtype) -> torch.Tensor:
        """A real CPU tensor holding these values (of its own bytes only where every element is one value)."""
        with unset_fake_temporarily():
            if self.nonzero() in (0.0, 1.0):
                return torch.full(shape, self.value if self.nonzero() else 0.0, dtype=dtype)
            p = torch.arange(math.prod(shape), dtype=torch.float64)
            on = torch.floor((p + 1) * self.density) > torch.floor(p * self.density)
            return torch.where(on, self.value, 0.0).to(dtype).reshape(shape)


#: what a read of a tensor that nothing is known about answers (`_Tracer`)
_UNKNOWN = Fill(1.0)


class _Tracer(TorchDispatchMode):
    """Under the FakeTensorMode: counts CUDA storages, applies NCCL's rules to collectives (c10d ops, whose
    process group is an argument), counts host synchronizations, and answers data-dependent reads (no values
    exist) from a value model (`Fill` per tensor):

    - finiteness checks pass (`isfinite` is all True, `isnan` all False), and what follows from them through
      logical operations, reductions and views;
    - creations know their values (`zeros`, `ones`, `full`, `fill_`); sums of known tensors are known;
    - routing is balanced: the indices of a `topk` of k out of n pick every one of the n equally often, so a
      `scatter` of them into zeros is nonzero at a fraction k/n of each row and column (Megatron's routing map),
      its column sums are tokens·k/n each (tokens per expert), and collectives pass the counts on as every
      rank's (all-gather, all-to-all; an all-reduce's SUM multiplies by the group's size);
    - what is read of anything else: a boolean True (a mask selects everything), a number 1.

    A read is `.item()` (and `bool()`, `int()`), a copy to the host (`.cpu()`, `.tolist()`, `.to("cpu")`, a
    `copy_` into a real host tensor: it gives a real CPU tensor holding the model's values, on which host code
    then computes for real), or a size that depends on values (`nonzero`, `masked_select`, `x[mask]`). A `copy_`
    into a host tensor made inside the context (a pinned master copy) keeps it fake: it costs no host memory
    however large the weight, and the model's values pass on to it. Each such read of a CUDA tensor, and
    each `torch.cuda.synchronize` or event or stream synchronize, is a host synchronization
    (`Trace.host_syncs`); a non-blocking copy is not (the synchronize that waits for it is)."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.values = WeakIdKeyDictionary()  # tensor -> (Fill, its version counter's value then)
        self.picks = WeakIdKeyDictionary()  # topk indices -> n, the size of the dimension they pick from

    def known(self, x) -> Fill | None:
        """What is known of `x`'s values: nothing once an in-place operation has changed it or a view of it
        (views share one version counter)."""
        fill, version = self.values.get(x, (None, None)) if isinstance(x, torch.Tensor) else (None, None)
        return fill if fill is not None and version == _version(x) else None

    def know(self, x: torch.Tensor, fill: Fill | None, mutated: bool = False) -> None:
        """Record `x`'s values; autograd counts an in-place operation's version after its kernel returns."""
        if fill is not None:
            self.values[x] = (fill, _version(x) + mutated)

    def _read(self, x: torch.Tensor):
        """The Python number a read of 0-dim `x` answers."""
        if x.device.type == "cuda":
            self.trace.sync(f"item of a {x.dtype} tensor")
        fill = self.known(x) or _UNKNOWN
        if x.dtype == torch.bool:
            return bool(fill.nonzero())
        return fill.value if x.is_floating_point() else int(fill.value)

    def _copied_to_host(self, x: torch.Tensor, non_blocking: bool) -> None:
        """A copy of `x` to the host: a host synchronization unless it is a non-blocking one of a CUDA tensor."""
        if not non_blocking and x.device.type == "cuda":
            self.trace.sync(f"copy of a {x.dtype} tensor to the host")

    def _to_host(self, x: torch.Tensor, dtype, non_blocking: bool) -> torch.Tensor:
        self._copied_to_host(x, non_blocking)
        fill = self.known(x) or _UNKNOWN
        return fill.real(tuple(x.shape), dtype or x.dtype)

    def _count(self, x: torch.Tensor, numel: int) -> int:
        """How many elements of `x` (a mask, or nonzero's input) of `numel` (broadcast) are not 0."""
        if x.device.type == "cuda":
            self.trace.sync(f"size of a selection by a {x.dtype} tensor")
        fill = self.known(x) or _UNKNOWN
        return round(numel * fill.nonzero())

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            _check_collective(func, args, self.trace)
            try:
                out = func(*args, **kwargs)
            except UnsupportedOperatorException:  # no fake kernel (the coalesced ones): nothing to compute
                return _done_work()
            self._collective(func, args)
            return out
        if func is aten.record_stream.default:  # no memory is reused while work is pending
            return None
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors) and \
                torch.device(kwargs.get("device") or "cpu").type == "cpu":  # host data (a read's): computed
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            return self._read(args[0])
        if func is aten._to_copy.default and args[0].device.type == "cuda" and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            return self._to_host(args[0], kwargs.get("dtype"), kwargs.get("non_blocking", False))
        if func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "cuda":
            dst, src, non_blocking = (*args, False)[:3]
            if isinstance(dst, FakeTensor):  # a host tensor without values (a pinned master): it stays so
                self._copied_to_host(src, non_blocking)
                func(*args, **kwargs)
                self.know(dst, self.known(src), mutated=True)
                return dst
            real = self._to_host(src, dst.dtype, non_blocking)
            with unset_fake_temporarily():
                dst.copy_(real.expand_as(dst) if real.shape != dst.shape else real)
            return dst
        if func is aten.nonzero.default:
            (x,) = args
            return torch.empty(self._count(x, x.numel()), x.dim(), dtype=torch.long, device=x.device)
        if func is aten.masked_select.default:
            x, mask = args
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            return x.new_empty(self._count(mask, math.prod(shape)))
        if func is aten.index.Tensor and _masked(args[1]):
            x, (mask,) = args
            return x.new_empty((self._count(mask, mask.numel()), *x.shape[mask.dim():]))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.know(out, self._infer(func, args, kwargs, out), func._schema.is_mutable)
        elif func is aten.topk.default:
            x, k, dim = (list(args) + [-1])[:3]
            self.picks[out[1]] = x.shape[dim]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                self.trace._add(t)
        return out

    def _infer(self, func, args, kwargs, out) -> Fill | None:
        """The value model's answer for `out = func(*args)` (class docstring), or None."""
        packet = func.overloadpacket
        a, b = (self.known(x) for x in (*args[:2], None)[:2])
        if packet in _KNOWN:
            return Fill(float(_KNOWN[packet]))
        if packet in _FILLS:
            value = _FILLS[packet](args, kwargs)
            return None if value is None else Fill(float(value))
        if packet in _VIEWS or func in _VIEWS:
            return a if a is None or out.dtype != torch.bool else Fill(float(bool(a.value)), a.density)
        if a is None and packet not in _AND_OR_SCATTER:
            return None
        if packet in _NEGATE:
            return Fill(1.0, 1 - a.nonzero())
        if packet in _SUM:
            n = args[0].numel() // max(out.numel(), 1)
            return Fill(a.value * a.density * n) if a.density == 1 or args[0].dim() <= 2 else None
        if packet is aten.any:
            return Fill(float(a.nonzero() > 0))
        if packet is aten.all:
            return Fill(float(a.nonzero() == 1))
        if packet in (aten.amax, aten.amin):
            return a if a.density == 1 else Fill((max if packet is aten.amax else min)(a.value, 0.0))
        if packet in _AND_OR_SCATTER:
            return self._combine(packet, args, a, b)
        return None

    def _combine(self, packet, args, a: Fill | None, b: Fill | None) -> Fill | None:
        if packet in (aten.scatter, aten.scatter_):  # scatter(zeros, dim, topk indices, 1 or src)
            dst, dim, index, src = args[:4]
            n = self.picks.get(index)
            if a is None or a.nonzero() or n is None:
                return None
            value = float(src) if not isinstance(src, torch.Tensor) else 1.0
            return Fill(value, index.shape[dim] / n)
        if packet in _AND:
            if 0.0 in (a and a.nonzero(), b and b.nonzero()):
                return Fill(0.0)
            if a is not None and b is not None and 1 in (a.density, b.density):
                return Fill(a.value * b.value, a.density * b.density)
            return None
        if packet in _OR and (a and a.nonzero() == 1 or b and b.nonzero() == 1):
            return Fill(1.0)
        if packet in _OR and a is not None and b is not None and a.nonzero() == b.nonzero() == 0:
            return Fill(0.0)
        return None

    def _collective(self, func, args) -> None:
        """A collective passes its input's values on to its output (every rank holds the same: balanced)."""
        name = func.overloadpacket.__name__
        if name in ("_allgather_base_", "alltoall_base_"):
            self.know(args[0], self.known(args[1]))
        elif name == "allreduce_":
            op = _RED_OP[args[2].op()]
            for t in args[0]:
                fill = self.known(t)
                if fill is not None and fill.density == 1 and op == "SUM":
                    self.know(t, Fill(fill.value * dist.ProcessGroup.unbox(args[1]).size()))


aten = torch.ops.aten
#: finiteness checks pass (`_Tracer`)
_KNOWN = {aten.isfinite: True, aten.isnan: False, aten.isinf: False, aten.isposinf: False, aten.isneginf: False}
#: the same checks as functions (some decompose before the dispatcher: `_Functions` records them)
_KNOWN_FUNCTIONS = {f: known for name, known in (("isfinite", True), ("isnan", False), ("isinf", False))
                    for f in (getattr(torch, name), getattr(torch.Tensor, name))}
#: creations and fills whose values are their arguments'
_FILLS = {aten.zeros: lambda a, k: 0, aten.zeros_like: lambda a, k: 0, aten.new_zeros: lambda a, k: 0,
          aten.zero_: lambda a, k: 0, aten.ones: lambda a, k: 1, aten.ones_like: lambda a, k: 1,
          aten.new_ones: lambda a, k: 1, aten.full: lambda a, k: a[1], aten.full_like: lambda a, k: a[1],
          aten.new_full: lambda a, k: a[2], aten.fill_: lambda a, k: a[1] if not isinstance(a[1], torch.Tensor)
          else None}
_NEGATE = (aten.logical_not, aten.bitwise_not)
_AND = (aten.logical_and, aten.bitwise_and, aten.__and__, aten.mul)
_OR = (aten.logical_or, aten.bitwise_or, aten.__or__)
_AND_OR_SCATTER = (*_AND, *_OR, aten.scatter, aten.scatter_)
_SUM = (aten.sum, aten.count_nonzero)
_VIEWS = {aten.index.Tensor, aten.view.default, aten.reshape.default, aten.expand.default, aten.slice.Tensor,
          aten.select.int, aten.clone.default, aten._to_copy.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.t.default, aten.transpose.int, aten.permute.default, aten.contiguous, aten._unsafe_view.default,
          aten.alias.default, aten.flatten.using_ints}


def _version(x: torch.Tensor) -> int:
    try:
        return x._version
    except RuntimeError:  # an inference-mode tensor has no version counter (and is never changed in place)
        return 0


def _done_work():
    """A completed c10d Work, what a collective that ran returns."""
    future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def _masked(indices) -> bool:
    """Whether an index list is one boolean mask (x[mask]), whose result size depends on the values."""
    return len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool


# -- NCCL's rules ---------------------------------------------------------------------------------------------
class NcclError(RuntimeError):
    """A collective on an NCCL group that a GPU rank's ProcessGroupNCCL would refuse (or that would corrupt or
    hang across ranks)."""


class NcclDeviceError(NcclError):
    """A collective on an NCCL group was given a tensor that is not on this rank's CUDA device."""


#: the dtypes ProcessGroupNCCL maps to an NCCL type (its `ncclDataType` table; bool and the float8 types travel
#: as uint8); any other (int16, uint16, complex, which torch.distributed views as real before c10d, quantized)
#: raises "Input tensor data type is not supported for NCCL process group" there
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.uint32, torch.int64, torch.uint64,
                         torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.bool,
                         torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
#: moved as bytes but never reduced: ProcessGroupNCCL refuses float8 in every reduction ("Float8 dtypes are not
#: currently supported for NCCL reductions"), whatever the NCCL version's own fp8 support
NCCL_UNREDUCED = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_REDUCTIONS = {"allreduce_", "allreduce_coalesced_", "reduce_", "reduce_scatter_", "_reduce_scatter_base_",
               "reduce_scatter_tensor_coalesced_"}
_RED_OP = {int(op): name for name, op in dist.ReduceOp.RedOpType.__members__.items()}
_NCCL_BITWISE = {"BAND", "BOR", "BXOR"}  # NCCL has no bitwise reductions


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it: the op, the group's global ranks, and its tensors' (shape, dtype);
    for an all-to-all with split sizes, the rows this rank sends to and receives from each peer."""
    op: str
    ranks: tuple[int, ...]
    tensors: tuple[tuple[tuple[int, ...], str], ...]
    sends: tuple[int, ...] | None = None
    receives: tuple[int, ...] | None = None


def _check_collective(func, args, trace: "Trace") -> None:
    """NCCL's rules on a c10d op of a `cuda:fake` group (which a GPU rank's ProcessGroupNCCL applies): every
    tensor on this rank's device (the current one), in a dtype NCCL moves (and reduces, for a reduction), sizes that keep the
    collective's contract; then the collective is logged (`Trace.collectives`) for `mismatched_collectives`."""
    groups = [dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
              and a._type().qualified_name().endswith("c10d.ProcessGroup")]
    if not groups or dist.get_backend(groups[0]) != "cuda:fake":
        return
    group, name = groups[0], func.overloadpacket.__name__
    tensors = [t for t in tree_flatten(list(args))[0] if isinstance(t, torch.Tensor)]
    where = f"{func} on an NCCL group"
    own = torch.device("cuda", torch._C._accelerator_getDeviceIndex())  # the rank's device: set_device's
    for t in tensors:
        if t.device != own:
            raise NcclDeviceError(f"{where} got a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}: NCCL takes "
                                  f"tensors on the rank's own device ({own}, torch.cuda.set_device's); move it "
                                  f"there first")
        if t.dtype not in NCCL_DTYPES:
            raise NcclError(f"{where} got a {t.dtype} tensor: ProcessGroupNCCL moves only "
                            f"{sorted(str(d) for d in NCCL_DTYPES)}; cast it (or view it as bytes) first")
    if name in _REDUCTIONS:
        op = _RED_OP[next(a for a in args if isinstance(a, torch.ScriptObject)
                          and a._type().qualified_name().endswith("c10d.ReduceOp")).op()]
        for t in tensors:
            if t.dtype in NCCL_UNREDUCED:
                raise NcclError(f"{where}: ProcessGroupNCCL reduces no float8 tensor ({t.dtype}); reduce in bf16 "
                                f"or fp32 and cast after")
            if op in _NCCL_BITWISE or op == "AVG" and t.dtype == torch.bool:
                raise NcclError(f"{where}: NCCL cannot reduce {t.dtype} with ReduceOp.{op}; use SUM, MIN or MAX")
    size = group.size()
    sends = receives = None
    if name in ("_allgather_base_", "_reduce_scatter_base_"):
        out, inp = args[0], args[1]
        whole, part = (out, inp) if name == "_allgather_base_" else (inp, out)
        if whole.numel() != size * part.numel() or out.dtype != inp.dtype:
            raise NcclError(f"{where}: the whole tensor must hold {size} (the group's size) times the part in its "
                            f"dtype; got {tuple(whole.shape)} {whole.dtype} for a part of {tuple(part.shape)} "
                            f"{part.dtype}")
    elif name == "allgather_":
        for outs, inp in zip(args[0], args[1]):
            if len(outs) != size or any(o.shape != inp.shape or o.dtype != inp.dtype for o in outs):
                raise NcclError(f"{where}: all_gather needs {size} outputs of the input's shape and dtype "
                                f"{tuple(inp.shape)} {inp.dtype}; got {[(tuple(o.shape), o.dtype) for o in outs]}")
    elif name == "alltoall_base_":
        out, inp, receives, sends = args[0], args[1], tuple(args[3]), tuple(args[4])
        for what, t, splits in (("output", out, receives), ("input", inp, sends)):
            if splits and (len(splits) != size or sum(splits) != t.shape[0]):
                raise NcclError(f"{where}: {what} split sizes {list(splits)} must be {size} (the group's size) and "
                                f"add up to the {what}'s first dimension {t.shape[0]}")
            if not splits and t.shape[0] % size:
                raise NcclError(f"{where}: without split sizes the {what}'s first dimension {t.shape[0]} must "
                                f"divide by the group's size {size}")
        if out.dtype != inp.dtype or not (receives or sends) and out.numel() != inp.numel():
            raise NcclError(f"{where}: output {tuple(out.shape)} {out.dtype} and input {tuple(inp.shape)} "
                            f"{inp.dtype} must agree in dtype (and in size, without split sizes)")
    trace.collectives.append(Collective(name, tuple(dist.get_process_group_ranks(group)),
                                        tuple((tuple(t.shape), str(t.dtype)) for t in tensors),
                                        sends or None, receives or None))


def mismatched_collectives(logs: dict[int, list[Collective]]) -> list[str]:
    """What NCCL would hang on or corrupt, given the collectives each simulated rank issued (`Trace.collectives`
    of a trace per rank, keyed by global rank): for every group, each member rank that was traced must issue the
    same sequence of ops with the same tensor shapes and dtypes (an all-to-all's may differ: there, what rank a
    sends to rank b must be what b receives from a). Empty when they agree."""
    problems: list[str] = []
    per_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rank, log in logs.items():
        for c in log:
            per_group.setdefault(c.ranks, {}).setdefault(rank, []).append(c)
    for ranks, seqs in per_group.items():
        (first, ref), *others = sorted(seqs.items())
        for rank, seq in others:
            if len(seq) != len(ref):
                problems.append(f"group {list(ranks)}: rank {first} issues {len(ref)} collectives, rank {rank} "
                                f"{len(seq)} (the extra ones hang)")
            for i, (a, b) in enumerate(zip(ref, seq)):
                split = a.op == b.op == "alltoall_base_" and a.sends is not None
                if a.op != b.op or not split and a.tensors != b.tensors:
                    problems.append(f"group {list(ranks)}, collective {i}: rank {first} {a.op} {a.tensors}, rank "
                                    f"{rank} {b.op} {b.tensors}")
                    continue
                if split:
                    for x, y, cx, cy in ((first, rank, a, b), (rank, first, b, a)):
                        if cx.sends[ranks.index(y)] != cy.receives[ranks.index(x)]:
                            problems.append(f"group {list(ranks)}, all-to-all {i}: rank {x} sends "
                                            f"{cx.sends[ranks.index(y)]} rows to rank {y}, which expects "
                                            f"{cy.receives[ranks.index(x)]}")
    return problems


class _FakeMode(FakeTensorMode):
    """FakeTensorMode that never computes on CUDA for real: torch.cuda says it is available here, so the mode
    would otherwise run device moves of constant tensors (`torch.tensor([n]).to("cuda")`) on the device."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class _Functions(TorchFunctionMode):
    """Above the fake mode: finiteness checks recorded for `_Tracer` (as functions: some decompose before
    the dispatcher); `torch.tensor` of a list of tensors reads them as `_Tracer` does. A tensor over real bytes (a checkpoint read from disk) is made outside
    it: a real CPU tensor, which fake CUDA parameters copy like any CPU tensor. `param.data = x` (Megatron's
    DDP moves parameters into its buffers so) gives a fake tensor the device of `x`, as it does a real one."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if any(isinstance(a, torch.UntypedStorage) and a.device.type == "cpu" for a in args):
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        if func is torch.tensor and args and isinstance(args[0], (list, tuple)):  # reads each tensor in it
            args = (tree_map_only(torch.Tensor, self.tracer._read, args[0]), *args[1:])
        out = func(*args, **(kwargs or {}))
        if func in _KNOWN_FUNCTIONS and isinstance(out, torch.Tensor):
            self.tracer.know(out, Fill(float(_KNOWN_FUNCTIONS[func])))
        if func == _SET_DATA and isinstance(args[0], FakeTensor) and isinstance(args[1], FakeTensor):
            args[0].fake_device = args[1].fake_device
        return out


_SET_DATA = torch._C.TensorBase.data.__set__
_SDPA = torch.nn.functional.scaled_dot_product_attention


def _attention(query, *args, **kwargs):
    """`scaled_dot_product_attention` inside the façade: `_efficient_attention` on a fake CUDA device."""
    return (_efficient_attention if query.device.type == "cuda" else _SDPA)(query, *args, **kwargs)


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """`scaled_dot_product_attention` on a fake CUDA device as a GPU runs it with a mask: the fused
    memory-efficient kernel (flash attention takes no mask), which keeps the output and the log-sum-exp for
    its backward, not the [b, heads, s, s] probabilities. A CPU build has no CUDA kernel to choose one by, and
    torch's fallback (the math path) would count the probabilities. A boolean mask becomes the additive one
    in the query's dtype, as SDPA turns it for this kernel."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # the kernel takes as many k, v heads as q heads
        key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3) for t in (key, value))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                float("-inf"))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None if attn_mask is None else attn_mask.expand(*query.shape[:-2], *attn_mask.shape[-2:]),
        grad, dropout_p, is_causal, scale=scale)[0]


def _short(path: str) -> str:
    """A source path from its package down (`megatron/core/...`, `qurl_mcore/...`)."""
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("site-packages"):])
    root = Path(__file__).resolve().parents[1]
    return str(Path(path).relative_to(root)) if Path(path).is_relative_to(root) else path


class _Event:
    trace: Trace | None = None  # the context's (fake_cuda sets it): a synchronize counts there

    def __init__(self, *args, **kwargs): ...
    def record(self, stream=None) -> None: ...
    def wait(self, stream=None) -> None: ...

    def synchronize(self) -> None:
        self.trace.sync("an event's synchronize")

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream(torch.Stream):
    """A CUDA stream on which nothing waits: no work runs, so there is nothing to order. A torch.Stream (stream
    0 of its device), which `Tensor.record_stream` requires."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        index = torch._C._accelerator_getDeviceIndex() if device is None else _index(device)
        return super().__new__(cls, stream_id=0, device_index=index, device_type=1)  # 1: CUDA

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...

    def synchronize(self) -> None:
        _Event.trace.sync("a stream's synchronize")

    def query(self) -> bool:
        return True

    def record_event(self, event=None) -> _Event:
        return event or _Event()


def _index(device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return device.index or 0


def _cuda_answers(devices: int, gpu: Gpu, trace: Trace) -> dict[str, Any]:
    """The torch.cuda functions Megatron and SGLang call, answering for `devices` fake GPUs of kind `gpu`; the
    current device is the shim's (C++ and Python agree on it)."""

    def set_device(device) -> None:
        index = _index(device)
        if not 0 <= index < devices:
            raise RuntimeError(f"CUDA device {index} does not exist: this trace has {devices} (fake_cuda(devices=))")
        torch._C._accelerator_setDeviceIndex(index)
        # the fake mode's dispatch cache (one per process) keys `device="cuda"` without the current device
        FakeTensorMode.cache_clear()

    @contextlib.contextmanager
    def device_(device):
        before = torch._C._accelerator_getDeviceIndex()
        set_device(device)
        try:
            yield
        finally:
            set_device(before)

    def properties(device=None):
        return types.SimpleNamespace(name=gpu.name, total_memory=gpu.memory_bytes, major=gpu.capability[0],
                                     minor=gpu.capability[1], multi_processor_count=gpu.multi_processor_count,
                                     is_integrated=False, is_multi_gpu_board=False)

    def allocated(device=None) -> int:
        trace._prune()
        return trace.live_bytes

    return dict(
        is_available=lambda: True, device_count=lambda: devices, is_initialized=lambda: True,
        current_device=torch._C._accelerator_getDeviceIndex, set_device=set_device, device=device_,
        get_device_capability=lambda device=None: gpu.capability, get_device_properties=properties,
        get_device_name=lambda device=None: gpu.name, get_arch_list=lambda: ["sm_{}{}".format(*gpu.capability)],
        is_bf16_supported=lambda including_emulation=True: gpu.capability >= (8, 0),
        Stream=_Stream, Event=_Event, current_stream=_Stream, default_stream=_Stream,
        stream=lambda s=None: contextlib.nullcontext(s), _lazy_init=lambda: None,
        is_current_stream_capturing=lambda: False,
        synchronize=lambda device=None: trace.sync("torch.cuda.synchronize"), empty_cache=lambda: None,
        memory_allocated=allocated, memory_reserved=allocated, max_memory_allocated=lambda d=None: trace.peak_bytes,
        max_memory_reserved=lambda d=None: trace.peak_bytes,
        mem_get_info=lambda device=None: (gpu.memory_bytes - allocated(), gpu.memory_bytes),
        reset_peak_memory_stats=lambda device=None: trace.reset_peak(),
        manual_seed=lambda seed: None, manual_seed_all=lambda seed: None,
        get_rng_state=lambda device="cuda": torch.get_rng_state(), set_rng_state=lambda state, device="cuda": None,
        default_generators=tuple(torch.Generator() for _ in range(devices)),  # Megatron's RNG tracker sets them
    )


#: the RNG functions torch.cuda.random also holds (Megatron's RNG tracker calls them there)
_RNG = ("manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state")


@contextlib.contextmanager
def _patched(owner, values: dict[str, Any]) -> Iterator[None]:
    missing = object()
    saved = {name: getattr(owner, name, missing) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _gloo_as_fake(new_group):
    """dist.new_group with backend gloo -> the `fake` backend (CPU tensors allowed, as on gloo)."""

    def wrapper(*args, backend=None, **kwargs):
        return new_group(*args, backend="fake" if backend == "gloo" else backend, **kwargs)

    return wrapper


def _all_gather_object(object_list: list, obj: Any, group=None) -> None:
    object_list[:] = [obj] * len(object_list)


#: object collectives pickle into tensors and read them back; with no other rank running, every rank is taken
#: to hold what this one holds (a broadcast leaves the list as it is)
_OBJECT_COLLECTIVES = dict(all_gather_object=_all_gather_object,
                           broadcast_object_list=lambda object_list, src=None, group=None, device=None, **kw: None)


def shim_loaded() -> bool:
    """Whether this process started with the runtime shim (torch sees CUDA as its accelerator)."""
    return torch._C._get_accelerator().type == "cuda"


@contextlib.contextmanager
def fake_cuda(devices: int = 1, *, world_size: int = 1, rank: int = 0, gpu: str = "H100-80GB",
              device: int = 0) -> Iterator[Trace]:
    """Trace on `devices` fake GPUs of kind `gpu` (`GPUS`), current device `device`, as rank `rank` of a
    `cuda:fake` process group of `world_size` ranks. Yields the `Trace` of CUDA bytes alive (module docstring
    says what the façade catches and what it cannot). Needs a process started by `run_traced`."""
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; use one of {sorted(GPUS)}")
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices={devices}: the façade has 1 to {MAX_DEVICES} devices (one node)")
    if not shim_loaded():
        raise RuntimeError("the fake CUDA runtime is not loaded: trace in a process started by "
                           "qurl_mcore.fakecuda.run_traced (the shim must load before torch)")
    if dist.is_initialized():
        raise RuntimeError("fake_cuda starts its own process group: destroy the current one first")
    trace = Trace()
    with contextlib.ExitStack() as stack:
        answers = _cuda_answers(devices, GPUS[gpu], trace)
        stack.enter_context(_patched(torch.cuda, answers))
        stack.enter_context(_patched(torch.cuda.random, {name: answers[name] for name in _RNG}))
        stack.enter_context(_patched(torch.version, {"cuda": CUDA_VERSION}))
        stack.enter_context(_patched(_Event, {"trace": trace}))
        stack.enter_context(_patched(torch.backends.cuda, {"is_built": lambda: True}))
        stack.enter_context(_platform_probes_forgotten())
        stack.enter_context(_patched(dist, {"new_group": _gloo_as_fake(dist.new_group), **_OBJECT_COLLECTIVES}))
        # a function, not a branch of `_Functions`: a torch function mode does not reach autograd's device thread,
        # where a checkpointed layer (full recompute) runs its forward again
        stack.enter_context(_patched(torch.nn.functional, {"scaled_dot_product_attention": _attention}))
        answers["set_device"](device)
        dist.init_process_group("cuda:fake", rank=rank, world_size=world_size, store=FakeStore())
        stack.callback(_destroy_groups)
        stack.enter_context(_FakeMode(allow_non_fake_inputs=True))
        tracer = stack.enter_context(_Tracer(trace))
        # FakeTensor's own tolist reads element by element: one copy to the host, as a real tensor's
        stack.enter_context(_patched(FakeTensor, {"tolist": lambda x: tracer._to_host(x, None, False).tolist()}))
        stack.enter_context(_Functions(tracer))
        yield trace


#: SGLang's platform probes (`is_cuda()`, `is_sm100_supported()`, ...), cached once per process
_PROBES = ("sglang.srt.utils.common",)


@contextlib.contextmanager
def _platform_probes_forgotten() -> Iterator[None]:
    """SGLang caches its platform probes (`functools.lru_cache`): forget their answers on entering the façade and
    on leaving it, so that each side sees its own platform. Module-level flags that SGLang computes at import
    (`_is_cuda = is_cuda()` in its layers) keep the platform of the import: import SGLang inside the context."""

    def forget() -> None:
        for name in _PROBES:
            for value in vars(sys.modules.get(name, types.ModuleType(name))).values():
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()

    forget()
    try:
        yield
    finally:
        forget()


def _destroy_groups() -> None:
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:  # Megatron keeps its groups in globals: drop them with ours
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the runtime shim and the traced process ------------------------------------------------------------------
_SHIM = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

// c10's test guard for CUDA: current device and streams kept per thread, nothing else.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace {
const c10::impl::DeviceGuardImplInterface* guard() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// CUDA hooks that report CUDA built and present (torch then takes it as the accelerator) and initialise nothing.
struct FakeCUDAHooks : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex current_device() const override { return guard()->getDevice().index(); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { guard()->setDevice({c10::DeviceType::CUDA, d}); }
};
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);
}
"""


def runtime_library() -> Path:
    """The shim (module docstring), compiled with the system's C++ compiler against this torch, once per torch
    installation (its version and directory: the shim finds torch's libraries by that path) and shim source
    (cached)."""
    torch_dir = Path(torch.__file__).resolve().parent
    digest = hashlib.sha256(f"{torch.__version__}{torch_dir}{_SHIM}".encode()).hexdigest()[:16]
    out = cache_dir() / "fakecuda" / f"shim-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    source = out.with_suffix(f".{os.getpid()}.cpp")
    source.write_text(_SHIM)
    tmp = out.with_suffix(f".{os.getpid()}.so")
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir / 'include'}",
           str(source), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
           "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise RuntimeError(f"the fake CUDA runtime needs a C++ compiler ({cmd[0]} not found; set CXX)") from err
    finally:
        source.unlink(missing_ok=True)
    if done.returncode:
        raise RuntimeError(f"compiling the fake CUDA runtime failed:\n{done.stderr[-2000:]}")
    tmp.replace(out)
    return out


def run_traced(fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> Any:
    """`fn(*args)` (a module-level function; arguments and result picklable) in a fresh Python process started
    with the fake CUDA runtime preloaded; `fn` enters `fake_cuda` itself. Raises RuntimeError with the child's
    traceback when it fails."""
    env = {**os.environ, "LD_PRELOAD": str(runtime_library())}
    call = pickle.dumps((sys.path, fn.__module__, fn.__qualname__, args))
    done = subprocess.run([sys.executable, "-m", "qurl_mcore.fakecuda"], input=call, capture_output=True, env=env,
                          timeout=timeout, cwd=os.getcwd())
    if done.returncode:  # the dispatcher's lists of registered kernels say nothing here
        lines = [line for line in done.stderr.decode().splitlines() if "registered at" not in line]
        raise RuntimeError(f"{fn.__qualname__} failed under fake CUDA:\n" + "\n".join(lines)[-6000:])
    return pickle.loads(done.stdout)


def _child() -> None:
    path, module, name, args = pickle.loads(sys.stdin.buffer.read())
    sys.path[:] = path  # the caller's: its modules import alike
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    result_fd = os.dup(1)
    os.dup2(2, 1)  # what the function prints goes to stderr; stdout carries the result only
    result = fn(*args)
    with os.fdopen(result_fd, "wb") as out:
        out.write(pickle.dumps(result))
    sys.stderr.flush()
    # The result is out. Tearing torch down after autograd ran on the fake device's thread can abort at exit
    # ("terminate called without an active exception": that thread's std::thread is destroyed unjoined), which
    # would fail a trace that succeeded; nothing is left to clean up in this throwaway process.
    os._exit(0)


if __name__ == "__main__":
    _child()
