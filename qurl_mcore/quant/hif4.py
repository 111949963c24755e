"""HiF4 (HiFloat4): units of 64 four-bit S1E1M2 elements under a three-level scale, 4.5 bits a value.

For a unit U of 64 consecutive elements along the last dim, split into 8 groups G8 of 8 and 16 groups G4 of 4:

  level 1   a = E6M2(amax(U) / 7)                 one 8-bit scale per unit (E6M2: bias 48, 2 mantissa bits)
  level 2   b = [amax(G8) / a >= 4]               one bit per 8 elements, a factor 2^b
  level 3   c = [amax(G4) / (a·2^b) >= 2]         one bit per 4 elements, a factor 2^c
  elements  q = E1M2(x / s),  x' = q·s,  s = a·2^b·2^c   (S1E1M2: ±{0, 0.25, ..., 1.75}, RNE, saturating)

7 = 1.75·2·2, the largest element times both micro factors, puts the unit's maximum at the top of the range.
Scale bits: 8 + 8·1 + 16·1 = 32 per 64 elements of 4 bits: 4.5 bits a value.

Sources: the HiFloat4 paper (arXiv 2602.11287: 64-element units, an E6M2 base scale and 1-bit micro-exponents
per 8 and per 4 elements, 32 bits of metadata), Huawei CANN's `hifloat4.h` (the S1E1M2 element) and the HiF4
reference quantizer of CANN's PTO-ISA test generators (the thresholds 7, 4 and 2, E6M2's bias and saturation).
That reference rounds its intermediates (amax, 1/7, the reciprocal scales, x·1/s) to bf16; this module divides
in fp32, so a value within bf16 rounding of a threshold or a rounding midpoint may land on the other side.
Below the reference's range (amax(U) < 7·2^-48, where its converter is undefined) the unit scale is E6M2's
smallest non-zero value; a unit of zeros gets scale code 0 and decodes to zeros; a unit holding NaN or inf gets
E6M2's unused all-ones code, NaN, so that it decodes to NaN and is never lost (`quantize_units` reads nothing
back to the host; `quantize` raises on it).

Storage (`qtensor.QTensor` of format "hif4", `pack_scale`): codes packed two per byte as every FP4 format's (the
first element in the low nibble), and per unit the 32 bits of scale as 4 bytes: byte 0 the E6M2 code, byte 1
the level-2 bits (bit i: G8 i), bytes 2-3 the level-3 bits (bit j of the little-endian 16-bit word: G4 j). The
public material fixes the bit budget (32 bits a unit), and CANN's PTO-ISA HiF4 GEMMs read the scales as uint8
columns per 64-element group, but it does not fix the order of the bits within them: this order is ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E6M2_NAN, e1m2_decode, e1m2_encode, e6m2_decode, e6m2_encode, e6m2_round, quotient

UNIT = 64  # elements sharing the E6M2 scale
MICRO8 = 8  # elements sharing a level-2 bit
MICRO4 = 4  # elements sharing a level-3 bit
BITS_PER_VALUE = (UNIT * 4 + 8 + UNIT // MICRO8 + UNIT // MICRO4) / UNIT  # 4.5


def sub_scales(unit_scale: torch.Tensor, micro8: torch.Tensor, micro4: torch.Tensor) -> torch.Tensor:
    """s = a·2^b·2^c per group of 4, fp32 [..., units, 16], from the E6M2 codes [..., units] and the bits."""
    a = e6m2_decode(unit_scale).unsqueeze(-1)
    b = micro8.repeat_interleave(MICRO8 // MICRO4, dim=-1)
    return a * torch.exp2(b.to(torch.float32) + micro4.to(torch.float32))


@dataclass
class Hif4Tensor:
    """A HiF4-quantized tensor with its three levels apart: `codes` the E1M2 codes (uint8, one per element, the
    original shape), and per unit along the last dim `unit_scale` the E6M2 codes (uint8 [..., units]), `micro8`
    and `micro4` the level-2 and level-3 bits (bool [..., units, 8] and [..., units, 16])."""

    codes: torch.Tensor
    unit_scale: torch.Tensor
    micro8: torch.Tensor
    micro4: torch.Tensor

    def scale(self) -> torch.Tensor:
        """s = a·2^b·2^c per group of 4, fp32 [..., units, 16]."""
        return sub_scales(self.unit_scale, self.micro8, self.micro4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x' = E1M2(codes)·s in the original shape."""
        n = self.codes.shape[-1]
        values = _units(e1m2_decode(self.codes)).unflatten(-1, (-1, MICRO4))
        return (values * self.scale().unsqueeze(-1)).flatten(-3)[..., :n].to(dtype)


def _units(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., units, 64], zero-padding a partial last unit (zeros change no amax)."""
    pad = -x.shape[-1] % UNIT
    return torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, UNIT))


def quantize_units(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's levels for units u [..., units, 64]: (E1M2 codes [..., units, 64], E6M2 codes
    [..., units], level-2 bits [..., units, 8], level-3 bits [..., units, 16]). Elementwise and reductions
    only, nothing read back to the host (graph-safe): a non-finite unit gets the NaN scale code. Quotients are
    IEEE fp32 divisions on every device (`formats.quotient`)."""
    x = u.to(torch.float32)
    mag = x.abs()
    amax = mag.amax(dim=-1)
    finite = amax.isfinite()
    a = e6m2_round(quotient(torch.where(finite, amax, 0.0), 7.0))
    safe_a = torch.where(a > 0, a, 1.0).unsqueeze(-1)  # a unit of zeros: every quotient below is 0
    b = quotient(mag.unflatten(-1, (-1, MICRO8)).amax(dim=-1), safe_a) >= 4.0
    b4 = torch.exp2(b.repeat_interleave(MICRO8 // MICRO4, dim=-1).to(torch.float32))
    c = quotient(mag.unflatten(-1, (-1, MICRO4)).amax(dim=-1), safe_a * b4) >= 2.0
    s = safe_a * b4 * torch.exp2(c.to(torch.float32))
    codes = e1m2_encode(quotient(x, s.repeat_interleave(MICRO4, dim=-1)))  # x's shape: one dynamic graph
    scale = torch.where(finite, e6m2_encode(a), E6M2_NAN).to(torch.uint8)
    return codes, scale, b, c


_BIT = 1 << torch.arange(8, dtype=torch.int32)  # bit i of a byte


def pack_scale(unit_scale: torch.Tensor, micro8: torch.Tensor, micro4: torch.Tensor) -> torch.Tensor:
    """A unit's 32 bits of scale as 4 uint8 [..., units, 4] (module docstring: E6M2 code, G8 bits, G4 bits)."""
    bits = torch.cat([micro8, micro4], dim=-1).unflatten(-1, (-1, 8)).to(torch.int32)  # [..., units, 3, 8]
    words = (bits * _BIT.to(bits.device)).sum(dim=-1)
    return torch.cat([unit_scale.to(torch.int32).unsqueeze(-1), words], dim=-1).to(torch.uint8)


def unpack_scale(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_scale`: (E6M2 codes [..., units], level-2 bits [..., units, 8], level-3 [..., units, 16])."""
    bits = (packed[..., 1:].to(torch.int32).unsqueeze(-1) & _BIT.to(packed.device)) != 0  # [..., units, 3, 8]
    bits = bits.flatten(-2)
    return packed[..., 0], bits[..., :UNIT // MICRO8], bits[..., UNIT // MICRO8:]


def quantize(x: torch.Tensor) -> Hif4Tensor:
    """HiF4-quantize `x` along its last dim (module docstring), the levels apart. Non-finite input raises
    `ValueError`. The trainer and the engines store HiF4 as a `QTensor` (`qtensor.quantize(x, "hif4", "block")`),
    the same numbers with the scale packed."""
    if not x.is_floating_point() or x.dim() == 0:
        raise TypeError(f"HiF4 quantizes floating-point tensors of at least one dim, got {x.dtype} {tuple(x.shape)}")
    x = x.detach().to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"cannot HiF4-quantize a tensor with non-finite values, shape {tuple(x.shape)}")
    codes, unit_scale, micro8, micro4 = quantize_units(_units(x))
    return Hif4Tensor(codes.flatten(-2)[..., : x.shape[-1]], unit_scale, micro8, micro4)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x' = dequantize(quantize(x)) in x's dtype."""
    return quantize(x).dequantize(x.dtype)
