"""The FP4 GEMM in Triton: Y = Q̃(X)·Q(W)ᵀ over the rows an expert was routed, with W packed as `QTensor`
stores it and X quantized in registers by `quantize_activation`'s rule.

One program computes a [BLOCK_M, BLOCK_N] tile of one expert's output for BLOCK_M routed slots (`align.py`):
  W:  two E2M1 codes a byte (element 2i in the low nibble), one scale a block of `BS` elements along K
      (NVFP4: E4M3 bits times the expert's fp32 tensor scale g_w; MXFP4: E8M0, a power of two), decoded in
      registers to c·s: a code times its block scale is exact in bf16 (at most 6 significant bits).
  X:  each row (a token) quantized on its own, as `quantize(x, fmt, "block", batch_dims=1)` does it:
        MXFP4  s = 2^(floor(log2 amax_block) − 2),  q = E2M1(x / s)
        NVFP4  g = amax_row / (6·448),  b = E4M3(amax_block / 6 / g),  q = E2M1(x / (b·g))
      every division correctly rounded (`div_rn`: Triton's `/` is approximate on GPUs), every rounding to
      nearest even (an IEEE addition of 2^23 rounds to an integer, a carry into the fp32 bits to 3 mantissa
      bits), so the codes and scales are `quantize`'s, bit for bit. NVFP4's g needs the row's amax: a pass
      over the row's K before the products (and one more for the residual's g under RC).
  RC: Q(X)·Q(W)ᵀ + Q(X − Q(X))·Q(W)ᵀ, the residual formed from Q(X)'s fp32 values as `residual_quantize`
      forms it. The operands (c·s) are exact bf16, so the MMAs multiply exactly and sum in fp32: MXFP4's two
      products go into one accumulator; NVFP4's carry different per-token scales g₁, g₂ (applied after
      accumulation), so each part has its accumulator, combined as g₁·acc₁ + g₂·acc₂, then times g_w.
  SCALED (MXFP4, Blackwell): the MMA takes the formats as stored, `tl.dot_scaled` on E2M1 codes two a byte
      (element 2i in the low nibble) with E8M0 scales per 32: the weights' bytes as loaded, X's codes and
      scale exponents packed the same way in registers. Every product c_x·2^a · c_w·2^b is exact in fp32 (2 + 2
      significant bits), summed in fp32 as the bf16 MMAs sum, so both variants meet the same bound; RC's second
      product (the residual's codes and scales) goes into the same accumulator. The product is taken as
      Cᵀ = W·Xᵀ: the weights' BN = 128 rows fill the block-scaled MMA's M, the BM routed slots its N.
  gated: W13's gate row j and up row j + I are loaded side by side, so one tile holds both halves of its
      output columns: h = bf16(silu(bf16(gate))) · bf16(up), rounded to the output's dtype at each step as
      `experts_forward` rounds (torch's bf16 silu and product).
The result differs from the fp32 reference only by the order of fp32 sums (docs/rollout.md states the bound).
Grids are static (the routed-slot capacity, not the count): a program past the routed blocks returns at once,
so nothing reads the host and CUDA graphs capture it.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: 2^23: adding it to a non-negative fp32 below 2^22 rounds that value to an integer, ties to even
_ROUND = tl.constexpr(8388608.0)
#: 1.5·2^14: adding it rounds to a multiple of 2^-9 (E4M3's subnormal step), ties to even
_E4M3_SUB = tl.constexpr(24576.0)
#: E2M1's largest magnitude times E4M3's: NVFP4's per-tensor scale divides a row's amax by it
_NV_RANGE = tl.constexpr(2688.0)


@triton.jit
def _e2m1_round(x):
    """x (already divided by its scale) to E2M1's grid: |x| clamped to 6, rounded to nearest even on each
    binade's uniform grid (steps 0.5, 1, 2 on [0, 2), [2, 4), [4, 6]); the sign kept."""
    mag = tl.minimum(tl.abs(x), 6.0)
    low, mid = mag < 2.0, mag < 4.0
    v = (mag * tl.where(low, 2.0, tl.where(mid, 1.0, 0.5)) + _ROUND) - _ROUND
    v = v * tl.where(low, 0.5, tl.where(mid, 1.0, 2.0))  # products by powers of two: exact
    return tl.where(x < 0, -v, v)


@triton.jit
def _e4m3_round(s):
    """Non-negative s <= 448 rounded to nearest even on E4M3's grid: 3 mantissa bits from 2^-6 up, a step of
    2^-9 below."""
    bits = s.to(tl.int32, bitcast=True)
    normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
    return tl.where(s >= 0.015625, normal, (s + _E4M3_SUB) - _E4M3_SUB)


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-127, 127] (2^-127 is subnormal), built from its bits."""
    return tl.where(e > -127, ((e + 127) << 23), 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _mx_quantize(xb):
    """Blocks xb [.., BS] -> (E2M1 values v, in [-6, 6]; E8M0 exponents floor(log2 amax) − 2 clamped to
    [-127, 127]): Q(xb) = v·2^exponent, MXFP4's rule."""
    amax = tl.max(tl.abs(xb), axis=2)
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129
    exponent = tl.minimum(tl.maximum(exponent, -127), 127)
    return _e2m1_round(xb * _pow2(-exponent)[:, :, None]), exponent  # exact: the quotient by a power of two


@triton.jit
def _quantize_tile(x, g, NV: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """x [BM, BK] fp32 (whole blocks of BS) -> (the MMA operand c·s, exact in bf16; Q(x)'s fp32 values).
    NVFP4: `g` [BM] is each row's tensor scale, outside the operand; MXFP4 ignores it."""
    xb = tl.reshape(x, (BM, BK // BS, BS))
    if NV:
        amax = tl.max(tl.abs(xb), axis=2)
        b = _e4m3_round(tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, 6.0), g[:, None]), 448.0))
        scale = b * g[:, None]
        positive = scale > 0
        scaled = tl.math.div_rn(xb, tl.where(positive, scale, 1.0)[:, :, None])
        v = _e2m1_round(tl.where(positive[:, :, None], scaled, 0.0))
        operand = v * b[:, :, None]
    else:
        v, exponent = _mx_quantize(xb)
        scale = _pow2(exponent)
        operand = v * scale[:, :, None]
    return tl.reshape(operand, (BM, BK)), tl.reshape(v * scale[:, :, None], (BM, BK))


@triton.jit
def _packed_tile(x, BM: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """x [BM, BK] fp32 (whole blocks of BS) -> MXFP4 as `tl.dot_scaled` takes it: E2M1 codes two a byte
    [BM, BK/2] uint8 (element 2i in the low nibble), E8M0 scale bytes [BM, BK/BS] uint8; and Q(x)'s fp32
    values. A code is sign·8 | (binade + 1)·2 | half for |v| >= 1 (fp32 bits: (bits >> 22) − 252), 2|v| below."""
    v, exponent = _mx_quantize(tl.reshape(x, (BM, BK // BS, BS)))
    mag = tl.abs(v)
    codes = tl.where(mag < 1.0, (mag * 2.0).to(tl.int32), (mag.to(tl.int32, bitcast=True) >> 22) - 252)
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8  # v's sign bit: −0 (x < 0 rounded to 0) is code 8
    codes = tl.reshape(codes | sign, (BM, BK // 2, 2))
    low, high = tl.split(codes)
    q = tl.reshape(v * _pow2(exponent)[:, :, None], (BM, BK))
    return (low | (high << 4)).to(tl.uint8), (exponent + 127).to(tl.uint8), q


@triton.jit
def _load_rows(a_ptr, a_rows, rmask, stride_am, k0, K, BK: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    return tl.load(ptrs, mask=rmask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _tensor_scales(a_ptr, a_rows, rmask, stride_am, K, RC: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                   BS: tl.constexpr):
    """NVFP4's per-row tensor scales g = amax/(6·448) (1 for a zero row) of X and, under RC, of X − Q(X)."""
    amax = tl.zeros((BM,), tl.float32)
    for k0 in range(0, K, BK):
        amax = tl.maximum(amax, tl.max(tl.abs(_load_rows(a_ptr, a_rows, rmask, stride_am, k0, K, BK)), axis=1))
    g1 = tl.where(amax > 0, tl.math.div_rn(amax, _NV_RANGE), 1.0)
    g2 = g1
    if RC:
        amax = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            x = _load_rows(a_ptr, a_rows, rmask, stride_am, k0, K, BK)
            _, q = _quantize_tile(x, g1, True, BM, BK, BS)
            amax = tl.maximum(amax, tl.max(tl.abs(x - q), axis=1))
        g2 = tl.where(amax > 0, tl.math.div_rn(amax, _NV_RANGE), 1.0)
    return g1, g2


@triton.jit
def _weight_bytes(w_ptr, s_ptr, w_rows, nmask, k0, K, stride_wn, stride_sn, BK: tl.constexpr, BS: tl.constexpr):
    """Rows `w_rows` of one expert's packed weight, columns k0..k0+BK, as stored: codes [BN, BK/2] and scale
    bits [BN, BK/BS], both uint8 (zero past K: a zero code, whatever its scale)."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    packed = tl.load(w_ptr + w_rows[:, None] * stride_wn + offs_b[None, :],
                     mask=nmask[:, None] & (offs_b < (K + 1) // 2)[None, :], other=0)
    offs_s = k0 // BS + tl.arange(0, BK // BS)
    sbits = tl.load(s_ptr + w_rows[:, None] * stride_sn + offs_s[None, :],
                    mask=nmask[:, None] & (offs_s < (K + BS - 1) // BS)[None, :], other=0)
    return packed, sbits


@triton.jit
def _weight_tile(w_ptr, s_ptr, w_rows, nmask, k0, K, stride_wn, stride_sn, NV: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, BS: tl.constexpr):
    """Rows `w_rows` of one expert's packed weight, columns k0..k0+BK, decoded to c·s in bf16 ([BN, BK])."""
    packed, sbits = _weight_bytes(w_ptr, s_ptr, w_rows, nmask, k0, K, stride_wn, stride_sn, BK, BS)
    packed, sbits = packed.to(tl.int32), sbits.to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))
    e, m = (codes >> 1) & 0x3, codes & 0x1
    mag = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23)).to(tl.float32, bitcast=True)
    values = tl.where((codes & 0x8) != 0, -mag, mag)
    if NV:  # E4M3 bits (a non-negative scale): 2^(e−7)·(1 + m/8), subnormal m·2^-9
        se, sm = (sbits >> 3) & 0xF, sbits & 0x7
        scale = tl.where(se > 0, (((se + 120) << 23) | (sm << 20)).to(tl.float32, bitcast=True),
                         sm.to(tl.float32) * 0.001953125)
    else:  # E8M0: 2^(bits − 127); 255 (NaN by OCP) decodes to inf, which poisons rather than hides
        scale = _pow2(sbits - 127)
    w = tl.reshape(values, (BN, BK // BS, BS)) * scale[:, :, None]
    return tl.reshape(w, (BN, BK)).to(tl.bfloat16)


@triton.jit
def fp4_moe_gemm(a_ptr, stride_am, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, wg_ptr,
                 c_ptr, stride_cm, sorted_ptr, expert_ptr, padded_ptr, slots, N, K,
                 A_DIV: tl.constexpr, NV: tl.constexpr, RC: tl.constexpr, GATED: tl.constexpr,
                 SCALED: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[slot, n] = Σ_k Q̃(A[slot // A_DIV])[k] · Q(W_e)[n, k] for the BLOCK_M slots of routed block
    program_id(0) (all of expert e), output columns of tile program_id(1). GATED: N is the intermediate size I
    of a W13 of 2I rows, and C holds silu(gate)·up. SCALED (MXFP4 only): the products by `tl.dot_scaled`."""
    tl.static_assert(not (SCALED and NV), "tl.dot_scaled takes MXFP4 (E8M0 scales), not NVFP4")
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BM >= tl.load(padded_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    rmask = rows < slots
    a_rows = (rows // A_DIV).to(tl.int64)
    if GATED:  # gate row j beside up row j + N: output column j's two halves in one tile
        cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        w_rows = tl.reshape(tl.join(cols, cols + N), (BN,))
        nmask = tl.reshape(tl.join(cols < N, cols < N), (BN,))
    else:
        cols = pid_n * BN + tl.arange(0, BN)
        w_rows, nmask = cols, cols < N
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    g1 = tl.full((BM,), 1.0, tl.float32)
    g2 = g1
    if NV:
        g1, g2 = _tensor_scales(a_ptr, a_rows, rmask, stride_am, K, RC, BM, BK, BS)
    acc1 = tl.zeros((BM, BN), tl.float32)
    acc2 = tl.zeros((BM, BN), tl.float32)
    acc_t = tl.zeros((BN, BM), tl.float32)  # SCALED: Cᵀ = W·Xᵀ, the weights' BN rows as the MMA's M
    for k0 in range(0, K, BK):
        x = _load_rows(a_ptr, a_rows, rmask, stride_am, k0, K, BK)
        if SCALED:
            w, ws = _weight_bytes(w_ptr, s_ptr, w_rows, nmask, k0, K, stride_wn, stride_sn, BK, BS)
            codes, xs, q = _packed_tile(x, BM, BK, BS)
            acc_t = tl.dot_scaled(w, ws, "e2m1", tl.trans(codes), xs, "e2m1", acc_t)
            if RC:
                codes, xs, _ = _packed_tile(x - q, BM, BK, BS)
                acc_t = tl.dot_scaled(w, ws, "e2m1", tl.trans(codes), xs, "e2m1", acc_t)
        else:
            w = tl.trans(_weight_tile(w_ptr, s_ptr, w_rows, nmask, k0, K, stride_wn, stride_sn, NV, BN, BK, BS))
            operand, q = _quantize_tile(x, g1, NV, BM, BK, BS)
            acc1 = tl.dot(operand.to(tl.bfloat16), w, acc1)
            if RC:
                operand, _ = _quantize_tile(x - q, g2, NV, BM, BK, BS)
                if NV:
                    acc2 = tl.dot(operand.to(tl.bfloat16), w, acc2)
                else:
                    acc1 = tl.dot(operand.to(tl.bfloat16), w, acc1)
    if SCALED:
        acc1 = tl.trans(acc_t)
    if NV:
        acc1 = (acc1 * g1[:, None] + acc2 * g2[:, None]) * tl.load(wg_ptr + e)
    out_ty = c_ptr.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(acc1, (BM, BN // 2, 2)))
        gate = gate.to(out_ty).to(tl.float32)
        act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ty).to(tl.float32)
        acc = act * up.to(out_ty).to(tl.float32)
    else:
        acc = acc1
    ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(ptrs, acc.to(out_ty), mask=rmask[:, None] & (cols < N)[None, :])
