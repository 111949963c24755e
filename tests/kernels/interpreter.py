"""The Triton kernels on the CPU, through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton is imported (triton.language's own `@jit` functions are
decorated then), so interpreted tests run in a process of their own (`run_interpreted`). Triton 3.9's
interpreter gets two bf16 operations wrong, which `corrected_bf16()` corrects inside its emulation (changing no
kernel and no GPU code):
- `tl.dot` on bf16 tiles multiplies their uint16 bit patterns (numpy has no bf16): garbage. Corrected: the
  operands upcast to fp32 first (exact: bf16 ⊂ fp32), as a GPU's MMA multiplies bf16 exactly into fp32.
- fp32 -> bf16 casts (`.to(tl.bfloat16)`, a store into a bf16 tensor) drop the low 16 bits (round toward
  zero). Corrected: rounded to nearest even, as a GPU's cast (`cvt.rn.bf16.f32`, Triton's default) and
  torch round.
Triton's interpreter also runs no libdevice function (`tl.extra.cuda.libdevice.*` needs a compiler's
`_semantic`, and its builder raises on every extern call). `libdevice_round()` maps the one SGLang's INT8
activation quantizer calls, `__nv_roundf`, by libdevice's own definition (`round_half_away`)."""
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


def assert_interpreted_passes(path: str) -> None:
    """`run_interpreted(path)` ran every test of `path` and all passed (none skipped: the interpreter was on)."""
    done = run_interpreted(path)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, \
        done.stdout[-6000:] + done.stderr[-3000:]


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


def round_half_away(x: np.ndarray) -> np.ndarray:
    """libdevice's `__nv_roundf` on fp32 `x`: trunc(x + copysign(0.5, x)), the sum rounded toward zero
    (libdevice.10.bc: `add.rz` then `trunc`), i.e. to the nearest integer with halves away from zero, on every
    input (0.49999997 -> 0: the sum rounded toward zero stays below 1; |x| >= 2^23 stays x; -0.3 -> -0.0). The
    sum formed in fp64 is exact (24 significant bits plus a half), so its truncation is the rounded-toward-zero
    sum's."""
    x = np.asarray(x, dtype=np.float32)
    return np.trunc(x.astype(np.float64) + np.copysign(0.5, x)).astype(np.float32)


#: the libdevice symbols `libdevice_round()` maps: fp32 -> fp32, by their libdevice definition
_LIBDEVICE = {"__nv_roundf": round_half_away}


@contextlib.contextmanager
def libdevice_round() -> Iterator[None]:
    """`tl.extra.cuda.libdevice.round` runnable under the interpreter for the duration: the call gets the
    interpreter's semantic, and the builder's extern call computes `__nv_roundf` (`round_half_away`); any other
    extern symbol still raises as Triton ships it."""
    from triton import language as tl
    from triton.language.extra.cuda import libdevice
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, interpreter_semantic

    original_round, original_extern = libdevice.round, InterpreterBuilder.create_extern_elementwise

    @functools.wraps(original_round)
    def round_(arg0, _semantic=None):
        return original_round(arg0, _semantic=interpreter_semantic)

    @functools.wraps(original_extern)
    def create_extern_elementwise(self, lib_name, lib_path, symbol, args, ret_type, is_pure):
        if symbol not in _LIBDEVICE:
            return original_extern(self, lib_name, lib_path, symbol, args, ret_type, is_pure)
        return TensorHandle(_LIBDEVICE[symbol](args[0].data), tl.float32)

    libdevice.round, InterpreterBuilder.create_extern_elementwise = round_, create_extern_elementwise
    try:
        yield
    finally:
        libdevice.round, InterpreterBuilder.create_extern_elementwise = original_round, original_extern


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
