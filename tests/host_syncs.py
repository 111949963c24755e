"""Counting the host's reads of tensor values (what is a device-to-host synchronization on a GPU) on any device."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops whose result the host must wait for: a scalar read (.item(), bool(), int(), float()), and the ops whose
#: output size depends on the values (boolean indexing goes through nonzero)
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """Counts, while active, the ops in `READS`, boolean-mask indexing and `Tensor.tolist` calls (which read
    values without dispatching): `count`, and `ops` by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self._tolist = None

    @property
    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if func in READS or bool_index:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        ops, tolist = self.ops, self._tolist

        def counted(tensor, *a, **kw):
            ops.append("tolist")
            return tolist(tensor, *a, **kw)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
