"""Element formats: INT8, FP8 (E4M3, E5M2), FP4 E2M1 (for NVFP4 and MXFP4), FP4 E1M2 (for HiF4), and their
scale encodings.

Every function here maps *already scaled* values to a format's grid and back; choosing scales is
`qtensor.py`'s job (HiF4's three levels: `hif4.py`). All rounding is round-to-nearest-even (RNE).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from enum import Enum

import torch

#: E2M1 magnitudes indexed by their 3-bit code (sign is bit 3): exactly {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: E2M1's midpoints between neighbouring codes; round-to-nearest-even sends a tie to the even code.
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # after an even code
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # after an odd code
E2M1_MAX = 6.0
E1M2_MAX = 1.75
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
INT8_MAX = 127.0
E8M0_BIAS = 127


class Family(Enum):
    """What a format's elements are: integers, 8-bit floats, or 4-bit E2M1 floats on blocks."""

    INT = "int"
    FP8 = "fp8"
    FP4 = "fp4"


class ScaleEncoding(Enum):
    """How a format stores its scales: (bytes of one group's scale, bytes of one per-tensor scale, entries of
    one group's scale: the trailing dim of `QTensor.scale`)."""

    FP32 = (4, 0, 1)  # one fp32 scale per group
    E4M3_FP32 = (1, 4, 1)  # NVFP4: an E4M3 scale per block times an fp32 scale per tensor
    E8M0 = (1, 0, 1)  # MXFP4: a power-of-two scale per block, stored as a biased 8-bit exponent
    HIF4 = (4, 0, 4)  # HiF4: per 64-element unit an E6M2 scale and 8 + 16 micro-exponent bits, 4 bytes (hif4.py)


#: GEMM kernels that take a format's codes as stored: `quant.gemm`'s backends (torch._int_mm, torch._scaled_mm)
#: and SGLang's W8A8 kernels (`qurl_mcore.sglang.kernels`), with per-tensor/row scales; and the fused FP4
#: Triton GEMMs (`qurl_mcore.kernels`), on the format's own blocks
INT_MM, SCALED_MM, SGLANG_W8A8, TRITON_FP4 = "int8", "fp8", "sglang_w8a8", "triton_fp4"


@dataclass(frozen=True)
class FormatSpec:
    """A format's facts: its element `family` and `bits`, its largest value, the dtype that stores its codes
    (FP4: two per uint8), its scale encoding, its own block length along the last (reduction) dimension
    (None: scales follow the granularity) and the GEMM `kernels` that take it (`INT_MM`, `SCALED_MM`,
    `SGLANG_W8A8`, `TRITON_FP4`; emulation takes every format)."""

    name: str
    family: Family
    bits: int
    max_value: float
    storage_dtype: torch.dtype
    scale_encoding: ScaleEncoding
    block: int | None = None
    kernels: frozenset[str] = frozenset()
    element: str | None = None

    @property
    def is_fp4(self) -> bool:
        return self.family is Family.FP4

    @property
    def scale_bytes(self) -> int:
        """Bytes of one group's scale (a row's, a block's)."""
        return self.scale_encoding.value[0]

    @property
    def blocks_only(self) -> bool:
        """Whether the format scales its own blocks only (HiF4: its three levels live within a unit)."""
        return self.scale_encoding is ScaleEncoding.HIF4

    @property
    def scale_width(self) -> int:
        """Entries of one group's scale (the trailing dim of `QTensor.scale`): 1, HiF4's 4 bytes a unit."""
        return self.scale_encoding.value[2]

    @property
    def tensor_scale_bytes(self) -> int:
        """Bytes of the per-tensor scale on top of the group scales (NVFP4's fp32 one), else 0."""
        return self.scale_encoding.value[1]

    def weight_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] weight as the rollout engines store it: rows·cols·bits/8 of codes, one scale
        per `block` elements of a row (block formats) or per row (the others: per-channel), and the tensor
        scale. `qurl plan` sizes engines with it; a test checks it against real quantized weights."""
        groups = rows * math.ceil(cols / self.block) if self.block else rows
        return rows * cols * self.bits // 8 + groups * self.scale_bytes + self.tensor_scale_bytes


FORMATS: dict[str, FormatSpec] = {f.name: f for f in (
    FormatSpec("int8", Family.INT, 8, INT8_MAX, torch.int8, ScaleEncoding.FP32,
               kernels=frozenset({INT_MM, SGLANG_W8A8})),
    FormatSpec("fp8_e4m3", Family.FP8, 8, E4M3_MAX, torch.float8_e4m3fn, ScaleEncoding.FP32,
               kernels=frozenset({SCALED_MM, SGLANG_W8A8})),
    FormatSpec("fp8_e5m2", Family.FP8, 8, E5M2_MAX, torch.float8_e5m2, ScaleEncoding.FP32),
    FormatSpec("nvfp4", Family.FP4, 4, E2M1_MAX, torch.uint8, ScaleEncoding.E4M3_FP32, block=16,
               kernels=frozenset({TRITON_FP4}), element="e2m1"),
    FormatSpec("mxfp4", Family.FP4, 4, E2M1_MAX, torch.uint8, ScaleEncoding.E8M0, block=32,
               kernels=frozenset({TRITON_FP4}), element="e2m1"),
    FormatSpec("hif4", Family.FP4, 4, E1M2_MAX, torch.uint8, ScaleEncoding.HIF4, block=64, element="e1m2"),
)}


#: dtypes whose every value fp32 holds exactly (so a quotient of them may convert before it divides)
EXACT_IN_FP32 = (torch.bfloat16, torch.float16)


def quotient(a: torch.Tensor, b: torch.Tensor | float, *, inplace: bool = False) -> torch.Tensor:
    """a / b in fp32, rounded once (IEEE division) on every device, eagerly and under torch.compile alike, so
    that a GPU picks the scales and codes a CPU does. `inplace`: an fp32 `a` is the caller's temporary, which
    eagerly holds the quotient afterwards (no second buffer of its size).

    On CUDA, PyTorch's eager kernel divides by a Python number as a product with its fp32 reciprocal (up to
    1 ulp off): the divisor goes in as a tensor on a's device. Compiled for a GPU, inductor does the same to a
    constant divisor and Triton's fp32 `/` is approximate (up to 2 ulp): there the quotient is formed in fp64
    (`quotient_fp64`)."""
    if torch.compiler.is_compiling() and a.device.type != "cpu":
        return quotient_fp64(a, b)
    if not isinstance(b, torch.Tensor) and a.device.type != "cpu":
        b = torch.full((), b, dtype=torch.float32, device=a.device)
    if a.dtype in EXACT_IN_FP32:  # converted first: a CPU divides BF16 by a broadcast fp32 tensor 30x slower
        return a.to(torch.float32).div_(b)
    if inplace and a.dtype == torch.float32:
        return a.div_(b)
    return torch.div(a, b).to(torch.float32)


def quotient_fp64(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """a / b formed in fp64 and rounded once to fp32: fp32's correctly rounded quotient. The exact quotient
    of two fp32 numbers is never an fp32 rounding boundary and, when not on one, lies at least 2^-49 (relative)
    from the nearest; fp64's quotient, or its product with a rounded reciprocal, is within 2^-52 of exact, so
    it rounds to the same fp32 (tests/quant/test_qtensor.py checks both against fp32 division bitwise)."""
    return (a.to(torch.float64) / (b.to(torch.float64) if isinstance(b, torch.Tensor) else b)).to(torch.float32)


def get_format(fmt: str) -> FormatSpec:
    """Look a format up by name, with an error that lists the valid names."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {sorted(FORMATS)}") from None


def encode(scaled: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Round scaled fp32 values to the format's grid (RNE, saturating at ±max) and return the stored codes.
    `scaled` is a temporary of the caller's and is overwritten (a pass and an allocation fewer per step).

    INT8 -> int8 values; FP8 -> torch.float8_* values; FP4 -> uint8 codes of its element (E2M1, E1M2), one per
    element (unpacked).
    """
    clamped = scaled.clamp_(-spec.max_value, spec.max_value)
    if spec.family is Family.INT:
        return clamped.round_().to(spec.storage_dtype)  # torch's round is half-to-even
    if spec.is_fp4:
        return FP4_ELEMENTS[spec.element][0](clamped)
    return clamped.to(spec.storage_dtype)  # torch's float8 cast is RNE


def decode(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Inverse of `encode`: stored codes -> fp32 values on the unscaled grid."""
    if spec.is_fp4:
        return FP4_ELEMENTS[spec.element][1](codes)
    return codes.to(torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code, i.e. even mantissa) for |x| <= 6; bit 3 is the sign.

    Two formulas of the same function (bitwise: every fp16 value, tests/quant/test_formats.py), because the
    fast one eagerly is slow compiled and the other way round: counting midpoints in uint8 (eager, CUDA
    graphs) and rounding on each binade's grid in fp32 (torch.compile, whose CPU code is slow at uint8
    vector arithmetic). Both are elementwise with Python constants only: nothing waits for the host."""
    if torch.compiler.is_compiling():
        return _e2m1_encode_by_binade(x)
    return _e2m1_encode_by_midpoints(x)


def _e2m1_encode_by_midpoints(x: torch.Tensor) -> torch.Tensor:
    """code = #{midpoints below |x|}, where a midpoint after an odd code counts when |x| reaches it (its tie
    goes up to the even code) and one after an even code only when |x| passes it (its tie stays down). A
    comparison's bools are read as the uint8 0 or 1 they are stored as: adding them as bools would copy each
    into a uint8 tensor first."""
    mag = x.abs()
    code = (x < 0).view(torch.uint8) << 3
    for m in _E2M1_TIES_DOWN:
        code += (mag > m).view(torch.uint8)
    for m in _E2M1_TIES_UP:
        code += (mag >= m).view(torch.uint8)
    return code


def _e2m1_encode_by_binade(x: torch.Tensor) -> torch.Tensor:
    """E2M1's binades are uniform grids: [0, 2) in steps of 0.5 (codes 0-4), [2, 4) in steps of 1 (codes
    4-6), [4, 6] in steps of 2 (codes 6-7). So code = RNE(|x| / step) + offset with (step, offset) = (0.5, 0),
    (1, 2), (2, 4): the division by a power of two is exact, torch's round is half-to-even, and an even
    multiple of the step is an even code. A value that rounds up to the next binade's first point (1.9 -> 2)
    gets that point's code from either formula. The code, sign included (+8), is formed in fp32, cast once."""
    mag = x.abs()
    low, mid = mag < 2.0, mag < 4.0
    inv_step = torch.where(low, 2.0, torch.where(mid, 1.0, 0.5))
    offset = torch.where(low, 0.0, torch.where(mid, 2.0, 4.0)) + torch.where(x < 0, 8.0, 0.0)
    return (mag * inv_step).round_().add_(offset).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low nibble) -> fp32 values, assembled as fp32 bit patterns: exponent e = bits 1-2,
    mantissa m = bit 0, sign = bit 3. |v| = 2^(e-1) (1 + m/2) for e > 0 is biased exponent e + 126 with m as
    the mantissa's top bit; e = 0 is 0 or 0.5 = 2^-1 (biased exponent 126)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 0x3, c & 0x1
    bits = torch.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((c & 0x8) << 28)).view(torch.float32)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> fp32 values by looking each up in the 16 values of `_e2m1_values`, made on the codes'
    device (no host copy: graph-safe like `e2m1_encode`). A flat `index_select` because advanced indexing
    (`table[codes]`) runs torch's general gather, 3x slower on CPU: the rollout engine's emulated FP4 linear
    decodes every weight each call."""
    table = _e2m1_values(torch.arange(16, dtype=torch.uint8, device=codes.device))
    return table.index_select(0, codes.reshape(-1).to(torch.int64)).reshape(codes.shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim: element 2i in the low nibble, 2i+1 in the high one
    (the e2m1x2 layout of NVIDIA's PTX and torch.float4_e2m1fn_x2). An odd last dim is padded with a zero code.

    Each pair is read as one little-endian int16 (element 2i its low byte: every platform torch runs on), so
    the compiled kernel reads contiguous memory; strided slices [0::2], [1::2] made it scalar (14x slower)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    if torch.compiler.is_compiling():  # no storage offset to read in a trace; quantize packs a fresh buffer
        codes = codes.contiguous()
    elif not codes.is_contiguous() or codes.storage_offset() % 2:  # an int16 view needs both
        codes = codes.clone(memory_format=torch.contiguous_format)
    pairs = codes.view(torch.int16)
    return ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_fp4`, keeping the first `n` codes of the last dim."""
    wide = packed.to(torch.int16)
    return ((wide & 0xF) | ((wide & 0xF0) << 4)).view(torch.uint8)[..., :n]


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX shared exponent for an E2M1 block: floor(log2(amax)) - emax(E2M1)=2, clamped to E8M0's [-127, 127].

    A block of zeros gets the smallest exponent, so it decodes to zeros rather than NaN.
    """
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1), so floor(log2(amax)) = exp - 1
    shared = (exp - 1 - 2).to(torch.int32)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    return shared.clamp(-E8M0_BIAS, E8M0_BIAS)


# ---- HiF4's codes (the block quantizer is `hif4.py`) ----------------------------------------------------------

# HiFloat4's element (Huawei CANN `hifloat4.h`): S1E1M2, bias 1, so the magnitudes are k/4 for k = 0..7:
# 0.25, 0.5, 0.75 subnormal, 1 to 1.75 normal (E1M2_MAX). Bit 3 is the sign, as for E2M1.
#: HiF4's unit scale: E6M2, exponent bias 48, no subnormals; code 0 is zero. CANN's converter saturates at
#: exponent 63 with mantissa 2 (1.5 · 2^15), leaving the all-ones code unused: here it is NaN (E6M2_NAN), the
#: scale of a unit with a non-finite value, as E8M0's 255 is.
E6M2_BIAS = 48
E6M2_MAX = 1.5 * 2.0**15
E6M2_MIN = 1.25 * 2.0**-E6M2_BIAS  # the smallest non-zero code (1): 2^-48 itself is code 0, zero
E6M2_NAN = 255


def e1m2_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E1M2 code for x (uint8, bit 3 the sign), saturating at ±1.75. The grid is uniform (step 1/4),
    so the magnitude code is RNE(4|x|) capped at 7, and a tie goes to the even code (0.125 -> 0, 0.375 -> 2)."""
    mag = (x.abs() * 4.0).round_().clamp_(max=7.0)
    return (mag + torch.where(x < 0, 8.0, 0.0)).to(torch.uint8)


def e1m2_decode(codes: torch.Tensor) -> torch.Tensor:
    """E1M2 codes -> fp32 values: (code & 7) / 4, negated where bit 3 is set."""
    c = codes.to(torch.int32)
    mag = (c & 0x7).to(torch.float32) * 0.25
    return torch.where((c & 0x8) != 0, -mag, mag)


def e6m2_round(v: torch.Tensor) -> torch.Tensor:
    """v >= 0 rounded to the nearest E6M2 value (2 mantissa bits, RNE), saturating to [E6M2_MIN, E6M2_MAX];
    0 stays 0. With v = m·2^e (frexp: m in [0.5, 1)) the binade's step is 2^(e-3) and v/step lies in [4, 8)."""
    _, exp = torch.frexp(v)
    step = torch.ldexp(torch.ones_like(v), exp - 3)
    rounded = (v / step).round_() * step
    return torch.where(v > 0, rounded.clamp(E6M2_MIN, E6M2_MAX), 0.0)


def e6m2_encode(v: torch.Tensor) -> torch.Tensor:
    """E6M2 values (outputs of `e6m2_round`) -> uint8 codes: biased exponent in bits 2-7, mantissa in bits 0-1."""
    mant, exp = torch.frexp(v)  # v = (2·mant)·2^(exp-1), 2·mant in [1, 2)
    code = ((exp - 1 + E6M2_BIAS) << 2) + ((mant * 2.0 - 1.0) * 4.0).round().to(torch.int32)
    return torch.where(v > 0, code, 0).to(torch.uint8)


def e6m2_decode(codes: torch.Tensor) -> torch.Tensor:
    """E6M2 codes -> fp32: (1 + m/4)·2^(e-48) for code = e·4 + m, code 0 is zero and E6M2_NAN NaN."""
    c = codes.to(torch.int32)
    value = torch.ldexp(1.0 + (c & 0x3).to(torch.float32) * 0.25, (c >> 2) - E6M2_BIAS)
    return torch.where(c == E6M2_NAN, float("nan"), torch.where(c > 0, value, 0.0))


#: an FP4 element's (encode, decode) by `FormatSpec.element`: codes carry the sign in bit 3 in both
FP4_ELEMENTS = {"e2m1": (e2m1_encode, e2m1_decode), "e1m2": (e1m2_encode, e1m2_decode)}
