"""The Triton kernels on the CPU, through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton is imported (triton.language's own `@jit` functions are
decorated then), so interpreted tests run in a process of their own (`run_interpreted`). Triton 3.9's
interpreter gets two bf16 operations wrong, which `corrected_bf16()` corrects inside its emulation (changing no
kernel and no GPU code):
- `tl.dot` on bf16 tiles multiplies their uint16 bit patterns (numpy has no bf16): garbage. Corrected: the
  operands upcast to fp32 first (exact: bf16 ⊂ fp32), as a GPU's MMA multiplies bf16 exactly into fp32.
- fp32 -> bf16 casts (`.to(tl.bfloat16)`, a store into a bf16 tensor) drop the low 16 bits (round toward
  zero). Corrected: rounded to nearest even, as a GPU's cast (`cvt.rn.bf16.f32`, Triton's default) and
  torch round."""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(path: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """pytest on the test file `path` (relative to the repository) in a process with the interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-rs", path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _upcast_bf16(original):
    """The interpreter's `create_dot` with bf16 operands converted to fp32 first (`__wrapped__`: the original)."""
    from triton import language as tl
    from triton.runtime.interpreter import TensorHandle, _convert_float

    def fp32(h):
        return TensorHandle(_convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    @functools.wraps(original)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = fp32(a), fp32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    return create_dot


def _round_to_bf16(original):
    """The interpreter's `cast_impl` with fp32 -> bf16 rounded to nearest even (`__wrapped__`: the original).
    bf16 is fp32's top 16 bits: adding 0x7FFF plus the kept part's lowest bit, then dropping 16 bits, rounds
    to nearest with ties to even (a carry into the exponent is the next binade's first value)."""
    from triton import language as tl
    from triton.runtime.interpreter import TensorHandle

    @functools.wraps(original)
    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            return TensorHandle(rounded, tl.bfloat16)
        return original(self, src, dst_type)

    return cast_impl


#: InterpreterBuilder's methods corrected, with what corrects each
_CORRECTIONS = {"create_dot": _upcast_bf16, "cast_impl": _round_to_bf16}


@contextlib.contextmanager
def corrected_bf16() -> Iterator[None]:
    """The interpreter's bf16 dot and fp32 -> bf16 cast corrected for the duration."""
    from triton.runtime.interpreter import InterpreterBuilder

    originals = {name: getattr(InterpreterBuilder, name) for name in _CORRECTIONS}
    for name, correct in _CORRECTIONS.items():
        setattr(InterpreterBuilder, name, correct(originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(InterpreterBuilder, name, original)


@contextlib.contextmanager
def uncorrected() -> Iterator[None]:
    """Inside `corrected_bf16()`: the interpreter's own bf16 operations, as Triton ships them."""
    from triton.runtime.interpreter import InterpreterBuilder

    corrected = {name: getattr(InterpreterBuilder, name) for name in _CORRECTIONS}
    for name, method in corrected.items():
        setattr(InterpreterBuilder, name, method.__wrapped__)
    try:
        yield
    finally:
        for name, method in corrected.items():
            setattr(InterpreterBuilder, name, method)
