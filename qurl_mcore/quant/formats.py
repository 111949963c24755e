"""Element formats: INT8, FP8 (E4M3, E5M2), FP4 E2M1 (for NVFP4 and MXFP4), and their scale encodings.

Every function here maps *already scaled* values to a format's grid and back; choosing scales is
`qtensor.py`'s job. All rounding is round-to-nearest-even (RNE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: E2M1 magnitudes indexed by their 3-bit code (sign is bit 3): exactly {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
INT8_MAX = 127.0
E8M0_BIAS = 127


@dataclass(frozen=True)
class FormatSpec:
    """What a format stores per element and how its scales are encoded.

    `scale_encoding`: "fp32" (one float scale per group), "e4m3_fp32" (NVFP4: E4M3 block scale times an FP32
    per-tensor scale) or "e8m0" (MXFP4: power-of-two scale stored as a biased 8-bit exponent).
    `block` is the format's own block length along the last (reduction) dimension, or None.
    """

    name: str
    max_value: float
    storage_dtype: torch.dtype
    scale_encoding: str
    block: int | None = None

    @property
    def is_fp4(self) -> bool:
        return self.name in ("nvfp4", "mxfp4")


FORMATS: dict[str, FormatSpec] = {
    "int8": FormatSpec("int8", INT8_MAX, torch.int8, "fp32"),
    "fp8_e4m3": FormatSpec("fp8_e4m3", E4M3_MAX, torch.float8_e4m3fn, "fp32"),
    "fp8_e5m2": FormatSpec("fp8_e5m2", E5M2_MAX, torch.float8_e5m2, "fp32"),
    "nvfp4": FormatSpec("nvfp4", E2M1_MAX, torch.uint8, "e4m3_fp32", block=16),
    "mxfp4": FormatSpec("mxfp4", E2M1_MAX, torch.uint8, "e8m0", block=32),
}


def get_format(fmt: str) -> FormatSpec:
    """Look a format up by name, with an error that lists the valid names."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown quantization format {fmt!r}; use one of {sorted(FORMATS)}") from None


def encode(scaled: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Round scaled fp32 values to the format's grid (RNE, saturating at ±max) and return the stored codes.
    `scaled` is a temporary of the caller's and is overwritten (a pass and an allocation fewer per step).

    INT8 -> int8 values; FP8 -> torch.float8_* values; FP4 -> uint8 E2M1 codes, one per element (unpacked).
    """
    clamped = scaled.clamp_(-spec.max_value, spec.max_value)
    if spec.name == "int8":
        return clamped.round_().to(torch.int8)  # torch's round is half-to-even
    if spec.is_fp4:
        return e2m1_encode(clamped)
    return clamped.to(spec.storage_dtype)  # torch's float8 cast is RNE


def decode(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Inverse of `encode`: stored codes -> fp32 values on the unscaled grid."""
    if spec.is_fp4:
        return e2m1_decode(codes)
    return codes.to(torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code, i.e. even mantissa) for |x| <= 6; bit 3 is the sign.

    code = #{midpoints below |x|}, plus one at a midpoint whose lower neighbour has an odd code. Elementwise
    comparisons with Python constants only: no tensor is created and nothing waits for the host, so the
    function compiles into one fused kernel and can be captured in a CUDA graph."""
    mag = x.abs()
    below = sum((mag > m).to(torch.uint8) for m in _E2M1_MIDPOINTS)
    at_mid = sum((mag == m).to(torch.uint8) for m in _E2M1_MIDPOINTS)
    code = below + (at_mid & (below & 1))  # an odd lower code loses the tie
    sign = (x < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low nibble) -> fp32 values: exponent e = bits 1-2, mantissa m = bit 0,
    |v| = m / 2 for e = 0 (subnormal) and 2^(e-1) (1 + m / 2) otherwise (graph-safe like `e2m1_encode`)."""
    e = ((codes >> 1) & 0x3).to(torch.float32)
    m = (codes & 0x1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim: element 2i in the low nibble, 2i+1 in the high one
    (the e2m1x2 layout of NVIDIA's PTX and torch.float4_e2m1fn_x2). An odd last dim is padded with a zero code."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_fp4`, keeping the first `n` codes of the last dim."""
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return out[..., :n]


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX shared exponent for an E2M1 block: floor(log2(amax)) - emax(E2M1)=2, clamped to E8M0's [-127, 127].

    A block of zeros gets the smallest exponent, so it decodes to zeros rather than NaN.
    """
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1), so floor(log2(amax)) = exp - 1
    shared = (exp - 1 - 2).to(torch.int32)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    return shared.clamp(-E8M0_BIAS, E8M0_BIAS)
