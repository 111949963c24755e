"""SGLang's W8A8 fused-MoE Triton path, which the qurl plugin takes on CUDA for INT8/FP8 experts
(`qurl_mcore.sglang.kernels.moe_quant_info` into SGLang's Triton MoE runner), on the CPU through Triton's
interpreter, against the CPU path (`experts_forward`). Run by tests/kernels/test_sglang_w8a8_moe.py in a
process with `TRITON_INTERPRET=1` (tests/kernels/interpreter.py); skipped in any other.

What runs is SGLang's own code from the runner down: `fused_experts`, `fused_experts_impl`, both
`fused_moe_kernel` GEMMs and, for INT8, the `per_token_quant_int8` kernel, all Triton; the routing-weighted sum
of top-k > 2 is SGLang's `moe_sum_reduce_triton`, as on an H100. Around them, SGLang's runtime context (a
ServerArgs of the tiny checkpoint) and its `override_config` tile (16 x 32 x 64: K = 96 is one whole and one
partial step). The interpreter's bf16 cast is corrected as for the FP4 kernels (`corrected_bf16`: the GEMMs
store bf16). The smallest shims stand in for what neither the interpreter nor a CPU runs (`_shims`), none of
which changes a number the GPU path computes (6 up to the CUDA build's fast math, as it says):
1. `tl.extra.cuda.libdevice.round` (`__nv_roundf`): the interpreter maps no libdevice function. Mapped by
   libdevice's own definition, halves away from zero (`interpreter.round_half_away`, checked on a table).
2. `moe_align_block_size`: a CUDA op. SGLang's Triton version (`sglang/test/kernels/moe_align.py`) with the CUDA
   op's contract around it: ids shifted into E + 1 buckets (id -1, another rank's expert, in bucket 0), unused
   slots padded with T·k, bucket b's blocks given expert b - 1. Which row of its expert's blocks a slot takes
   changes no number: each row of a block is its own dot product (the contract: `test_alignment_...`).
3. `scaled_fp8_quant` (FP8 activations, per token): a CUDA kernel (`per_token_quant_fp8.cuh`). Transcribed:
   s = amax / 448, q = e4m3(clamp(x · (1 / s), ±448)), fp32 and round-to-nearest as the kernel's precise
   build. A zero token: s = 0 and codes 0 (the kernel's one-token-a-block variant, which decode batches take,
   writes codes 448 there: fminf(0·inf, 448)); times s = 0, its outputs are zero either way.
4. `outplace_fused_experts`, `inplace_fused_experts`: custom ops registered for CUDA tensors; called as their
   own functions, as SGLang itself calls them for CUDA tensors outside a graph (`_call_directly_in_eager`).
5. The CUDA branches of `fused_moe.py` (`_is_cuda`; `is_arch_support_pdl`: an H100 is SM90): the top-k sum
   and the activation as a GPU takes them, not the CPU fallbacks.
6. `silu_and_mul`: a CUDA kernel (`activation.cuh`). Transcribed: bf16(g / (1 + exp(-g)) · u) in fp32, one
   rounding (the CUDA build uses fast-math exp and division, within 2 fp32 ulp: a bf16 result rounds the same
   except within 2^-22 of a bf16 rounding boundary).

Where the two sides differ, and the bound.
- Activation codes (`test_activation_codes_equal_ours_except_at_exact_ties`). SGLang's INT8 quantizer
  multiplies by 127 / amax and rounds halves away from zero (libdevice `round`); ours divides by amax / 127 and
  rounds halves to even. Its FP8 quantizer multiplies by 1 / s; ours divides by s. On bf16 inputs both agree
  wherever x·max / amax is not exactly halfway between two codes: an exact quotient of 8-bit significands that
  is not a tie lies at least 2^-17 (relative) from one, and either side's fp32 is within 2^-22 of exact,
  2^-21 with a GPU's approximate fp32 division (Triton's `/`, fast math: 2 ulp). At a tie they can part by
  one code: by the rounding rule where the scale is exact (INT8, amax = 127·2^j), by which side of the tie
  each fp32 rounding falls otherwise (x = ±amax/2 is an INT8 tie in every token that holds it). The
  end-to-end tests' tokens hold no tie.
- GEMMs. INT8 dots are exact (in the interpreter and on a GPU; the int32 sums stay below 2^24, exact in fp32
  too) and are scaled after; the emulation sums products of dequantized values in fp32. FP8 dots run in the
  interpreter as fp16 operands summed in fp32 (the products are exact), on a GPU as MMAs into fp32. Either
  way the fp32 bound of interpreted_fp4.py: c·K·2^-24·M, M the terms' magnitude (`_magnitude_and_step`).
- bf16 roundings: SGLang stores h = X·W13ᵀ, the SiLU product (rounded once; the emulation rounds SiLU and the
  product) and each slot's routing-weighted output in bf16 and sums the slots; the emulation rounds each slot's
  output and sums the weighted slots in fp32. Four roundings at most on a path, 2^-8·M each.
- A down-GEMM activation that such a rounding moved may quantize to the next code: at most one code step of
  each element (S in `_magnitude_and_step`).
Per output: |SGLang − emulation| <= 8·(H + I)·2^-24·M + 4·2^-8·M + S. S is about 0.1·M: this end-to-end
bound catches a wrong expert, routing weight or layout, not a scale a few percent off. The tight check is
per GEMM (`test_each_gemm_equals_the_emulations_on_its_own_input`): each of SGLang's GEMMs against the
emulation's quantized linear of the same bf16 input, within the fp32 bound and one bf16 rounding (a scale off
by 2^-6 fails it).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qurl_mcore.quant import FORMATS, quantize
from qurl_mcore.quant.experts import experts_forward
from qurl_mcore.quant.formats import E4M3_MAX
from qurl_mcore.quant.linear import make_spec, quantize_activation, quantize_weight
from qurl_mcore.sglang.kernels import moe_quant_info
from qurl_mcore.sglang.weights import stack

from .interpreter import corrected_bf16, libdevice_round, round_half_away

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter from the process start: "
                                       "test_sglang_w8a8_moe.py runs it")

U = 2.0**-24
E, H, I = 8, 96, 48
FORMATS_W8A8 = ("int8", "fp8_e4m3")
#: expert ids: -1 another EP rank's (SGLang's dispatcher maps those to -1), expert 3 no token's (empty)
POOL = torch.tensor([-1, 0, 1, 2, 4, 5, 6, 7])
#: SGLang's tile for both GEMMs (`override_config`)
TILE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}


def _align_as_cuda(topk_ids: torch.Tensor, block_size: int, num_experts: int, **options):
    """Shim 2: SGLang's Triton alignment under its CUDA op's contract (+1 buckets, padding T·k, experts − 1)."""
    from sglang.test.kernels.moe_align import moe_align_block_size_triton

    if options:
        raise NotImplementedError(f"the alignment shim takes the runner's default call, not {options}")
    slots = topk_ids.numel()
    most = slots * block_size if slots < num_experts + 1 else slots + (num_experts + 1) * (block_size - 1)
    sorted_ids = torch.full((-(-most // 4) * 4,), slots, dtype=torch.int32)
    buckets = torch.zeros(triton.cdiv(sorted_ids.numel(), block_size), dtype=torch.int32)
    padded = torch.empty(1, dtype=torch.int32)
    moe_align_block_size_triton(topk_ids.reshape(-1).to(torch.int32) + 1, num_experts + 1, block_size, sorted_ids,
                                buckets, padded)
    return sorted_ids, buckets - 1, padded


def _per_token_fp8_as_cuda(x: torch.Tensor, scale=None, num_token_padding=None, use_per_token_if_dynamic=False):
    """Shim 3: `per_token_quant_fp8.cuh`'s arithmetic: s = amax / 448, q = e4m3(clamp(x · (1 / s), ±448))."""
    if scale is not None or num_token_padding or not use_per_token_if_dynamic:
        raise NotImplementedError("the FP8 shim is the dynamic per-token quantizer the runner calls")
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
    inverse = torch.where(s == 0, 0.0, 1.0 / s)
    return (xf * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def _silu_and_mul_as_cuda(x: torch.Tensor, out: torch.Tensor, **row_filter) -> None:
    """Shim 6: `activation.cuh`'s SiLU-and-multiply, bf16(g / (1 + exp(-g)) · u) in fp32. Rows a filter would
    skip are zero here (silu(0)·0), and the down GEMM writes zeros for them either way."""
    gate, up = x.float().chunk(2, dim=-1)
    out.copy_((gate / (1 + torch.exp(-gate)) * up).to(out.dtype))


def _shims():
    """(module, name, replacement) of shims 2-6; shim 1 is `libdevice_round()`."""
    import sglang.kernels.ops.moe.fused_moe_triton_kernels as kernels
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as fused

    return [(fused, "moe_align_block_size", _align_as_cuda),
            (kernels, "scaled_fp8_quant", _per_token_fp8_as_cuda),
            (fused, "outplace_fused_experts", fused.outplace_fused_experts.__wrapped__),
            (fused, "inplace_fused_experts", fused.inplace_fused_experts.__wrapped__),
            (fused, "_is_cuda", True),
            (fused, "is_arch_support_pdl", lambda: True),
            (fused, "silu_and_mul", _silu_and_mul_as_cuda)]


@pytest.fixture(scope="module")
def sglang_moe():
    """A function running SGLang's Triton MoE runner as the plugin does on CUDA, with the shims in force."""
    from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import override_config
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import create_context, get_parallel, use_context
    from sglang.srt.server_args import ServerArgs

    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as fused

    from qurl_mcore.models.tiny import tiny_checkpoint

    context = create_context(ServerArgs(model_path=str(tiny_checkpoint("glm4_moe")), device="cpu"), role="scheduler")

    def run(x, p, ids, w13, w2, fmt: str) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The runner's output, and each GEMM's bf16 input and output (`invoke_fused_moe_kernel`'s A and C)."""
        # one rank of two (EP 2): SGLang filters experts (`filter_expert`), as it does where ids can be -1
        config = MoeRunnerConfig(num_experts=2 * E, num_local_experts=E, hidden_size=H,
                                 intermediate_size_per_partition=I, top_k=ids.shape[1], params_dtype=x.dtype,
                                 activation="silu", is_gated=True)
        info = moe_quant_info(FORMATS[fmt], w13.data, w13.scale, w2.data, w2.scale)
        dispatch = StandardDispatchOutput(x.clone(), None, StandardTopKOutput(p, ids.to(torch.int32), None))
        gemms, invoke = [], fused.invoke_fused_moe_kernel

        def recorded(a, b, bias, c, *args, **kwargs):
            invoke(a, b, bias, c, *args, **kwargs)
            gemms.append((a.clone(), c.clone()))

        fused.invoke_fused_moe_kernel = recorded
        try:
            with (use_context(context), get_parallel().override(tp_group=None), override_config(dict(TILE)),
                  torch.no_grad()):
                out = MoeRunner(MoeRunnerBackend.TRITON, config).run(dispatch, info).hidden_states
        finally:
            fused.invoke_fused_moe_kernel = invoke
        return out, gemms

    shims = _shims()
    missing = object()  # a name SGLang binds only on CUDA (silu_and_mul)
    originals = [getattr(module, name, missing) for module, name, _ in shims]
    with corrected_bf16(), libdevice_round():
        for module, name, shim in shims:
            setattr(module, name, shim)
        try:
            yield run
        finally:
            for (module, name, _), original in zip(shims, originals):
                if original is missing:
                    delattr(module, name)
                else:
                    setattr(module, name, original)


@triton.jit
def _libdevice_round(x_ptr, y_ptr, N: tl.constexpr):
    """y = libdevice round(x), fp32: the call SGLang's INT8 activation quantizer makes."""
    n = tl.arange(0, N)
    tl.store(y_ptr + n, tl.extra.cuda.libdevice.round(tl.load(x_ptr + n)))


def _experts(fmt: str, g: torch.Generator):
    spec = make_spec("rc_none", fmt)
    w13, _ = stack([quantize_weight(torch.randn(2 * I, H, generator=g) / H**0.5, spec) for _ in range(E)])
    w2, _ = stack([quantize_weight(torch.randn(H, I, generator=g) / I**0.5, spec) for _ in range(E)])
    return spec, w13, w2


def _routing(tokens: int, k: int, g: torch.Generator):
    ids = torch.stack([POOL[torch.randperm(len(POOL), generator=g)[:k]] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=g), ids


def _activations(tokens: int, fmt: str, g: torch.Generator) -> torch.Tensor:
    """bf16 tokens, the engine's, the first all zeros, with no element on a tie of `fmt`'s codes (moved a bf16
    step toward zero: ties are `test_activation_codes_equal_ours_except_at_exact_ties`'s)."""
    x = torch.randn(tokens, H, generator=g)
    x[0] = 0
    x = x.to(torch.bfloat16)
    return torch.where(_ties(x, fmt), torch.nextafter(x, torch.zeros_like(x)), x)


def _ties(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Where x [tokens, n] (bf16) scaled per token, x·max_fmt / amax, is exactly halfway between two codes.
    Formed in fp64: an exact quotient of these 8-bit significands is representable, and one that is not a tie
    is never rounded onto one (it lies at least 2^-17 from it, relative)."""
    xf = x.double()
    amax = xf.abs().amax(-1, keepdim=True)
    v = torch.where(amax > 0, xf.abs() * FORMATS[fmt].max_value / amax, 0.0)
    if fmt == "int8":
        twice = 2 * v
        return (twice == twice.round()) & (twice.remainder(2) == 1)
    exponent = torch.floor(torch.log2(v.clamp(min=2.0**-6)))  # E4M3: 3 mantissa bits, subnormals below 2^-6
    units = v * torch.exp2(4 - exponent)  # halfway points are odd multiples of 2^(e - 4)
    return (units == units.round()) & (units.remainder(2) == 1)


def _magnitude_and_step(x, p, ids, w13, w2, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output: M = Σ_j |p_tj|·|Q(h_tj)|·|Q(W2_e)|ᵀ, the magnitude of the terms summed, and S = Σ_j |p_tj|·
    step(h_tj)·|Q(W2_e)|ᵀ, one code step of every element of the down GEMM's activation h_tj (INT8: the scale;
    FP8: E4M3's spacing at the element, times the scale), from the emulation's h."""
    w13f, w2f = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    xq = quantize_activation(x, spec)
    magnitude, step = torch.zeros(x.shape, dtype=torch.float32), torch.zeros(x.shape, dtype=torch.float32)
    for t, j in zip(*torch.where(ids >= 0)):
        e = ids[t, j]
        gate, up = (xq[t].float() @ w13f[e].t()).to(x.dtype).chunk(2)
        hidden = (F.silu(gate) * up).float()
        magnitude[t] += p[t, j].abs() * (quantize_activation(hidden[None], spec)[0].abs() @ w2f[e].abs().t())
        step[t] += p[t, j].abs() * (_code_step(hidden, spec.fmt) @ w2f[e].abs().t())
    return magnitude, step


def _code_step(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """The spacing of the codes at each element of one token v quantized per token."""
    s = v.abs().amax() / FORMATS[fmt].max_value
    if fmt == "int8":
        return s.expand_as(v)
    scaled = (v.abs() / s).clamp(min=2.0**-6) if s > 0 else torch.full_like(v, 2.0**-6)
    return torch.exp2(torch.floor(torch.log2(scaled)) - 3) * s


def test_libdevice_round_is_round_half_away_from_zero(sglang_moe):
    """Shim 1 in force, on a hand-derived table: halves away from zero (torch.round, half to even, differs on
    each tie), the largest fp32 below a half to zero, integers and |x| >= 2^23 unchanged, signed zeros kept."""
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0)))
    table = [(0.5, 1.0), (1.5, 2.0), (2.5, 3.0), (62.5, 63.0), (-0.5, -1.0), (-2.5, -3.0), (-126.5, -127.0),
             (8388607.5, 8388608.0), (below_half, 0.0), (-below_half, -0.0), (0.7, 1.0), (-1.2, -1.0),
             (127.0, 127.0), (2.0**23 + 1, 2.0**23 + 1), (2.0**24, 2.0**24), (-0.0, -0.0), (1e-40, 0.0)]
    x = torch.tensor([a for a, _ in table] + [0.0] * (32 - len(table)))
    expected = torch.tensor([b for _, b in table] + [0.0] * (32 - len(table)))
    y = torch.empty(32)
    _libdevice_round[(1,)](x, y, 32)
    assert torch.equal(y, expected) and torch.equal(y.signbit(), expected.signbit())
    assert torch.equal(torch.from_numpy(round_half_away(x.numpy())), y)
    ties = x.abs().remainder(1) == 0.5
    # half to even keeps 0.5, 2.5, 62.5, -0.5, -2.5, -126.5 a code lower in magnitude; 1.5 and 8388607.5 agree
    assert (torch.round(x)[ties] != y[ties]).sum() == 6


def test_alignment_keeps_the_cuda_ops_contract(sglang_moe):
    """Shim 2's alignment, as the CUDA op's: every slot once, in a block of its expert (-1: a block of expert
    -1, which the GEMMs skip); blocks of block_size rows, each bucket's padded with the slot count T·k; the
    padded length the buckets' sum of whole blocks."""
    g = torch.Generator().manual_seed(4)
    _, ids = _routing(7, 3, g)
    ids[0] = -1
    block = 4
    sorted_ids, block_expert, padded = _align_as_cuda(ids.to(torch.int32), block, E)
    used, slots = int(padded), ids.numel()
    counts = torch.bincount(ids.reshape(-1) + 1, minlength=E + 1)
    assert used == int(((counts + block - 1) // block * block).sum())
    rows = sorted_ids[:used]
    routed = rows < slots
    assert torch.equal(rows[routed].sort().values, torch.arange(slots, dtype=torch.int32))
    expert_of_row = block_expert[:used // block].repeat_interleave(block)
    assert torch.equal(expert_of_row[routed], ids.reshape(-1)[rows[routed].long()].to(torch.int32))
    assert (rows[~routed] == slots).all()


@pytest.mark.parametrize("fmt", FORMATS_W8A8)
def test_activation_codes_equal_ours_except_at_exact_ties(sglang_moe, fmt):
    """SGLang's per-token activation quantizer (INT8: its Triton kernel; FP8: shim 3) against `quantize`, on
    bf16 tokens: the same scales; the same codes except where x·max/amax is exactly halfway between two, which
    random tokens rarely hold and built ones do. INT8 ties with an exact scale (amax = 127·2^-6) are the
    rounding rule's: SGLang rounds them away from zero, ours to even, one code apart on every other tie."""
    import sglang.kernels.ops.moe.fused_moe_triton_kernels as kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, H, generator=g)
    x[1] = (torch.arange(H) - H // 2) / 128  # INT8: amax 127/64 makes x·127/amax = 64·x, odd multiples halves
    x[1, 0] = 127 / 64
    x[2] = (torch.arange(H) - H // 2) / 32  # FP8: amax 2 makes x·448/amax = 224·x: ±0.75 -> 168, ±1.5 -> 336
    x[2, 0] = 2
    x = x.to(torch.bfloat16)
    if fmt == "int8":
        codes, scales = kernels.per_token_quant_int8(x)
    else:
        codes, scales = kernels.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
    ours = quantize(x, fmt, "token")
    ties = _ties(x, fmt)
    differ = codes.float() != ours.data.float()
    assert torch.equal(scales, ours.scale)
    assert not (differ & ~ties).any(), f"codes differ off ties at {torch.where(differ & ~ties)}"
    if fmt == "int8":
        # the scale is exact (1/64): x·127/amax is the tie k + 1/2 itself; halves away from zero and to even
        # part where k is even, the same code where k is odd
        k = (x[1].double().abs() * 64).floor()
        assert ties[1].sum() == H // 2 and torch.equal(differ[1], ties[1] & (k.remainder(2) == 0))
        assert (codes.float() - ours.data.float()).abs().max() == 1
    else:
        assert ties[2].sum() >= 4
    print(f"{fmt}: {int(ties.sum())} ties of {x.numel()} elements, {int(differ.sum())} codes differ")


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("fmt", FORMATS_W8A8)
def test_each_gemm_equals_the_emulations_on_its_own_input(sglang_moe, fmt, k):
    """Each of SGLang's two GEMMs against the emulation's quantized linear of the same bf16 input (the up GEMM:
    the tokens; the down GEMM: SGLang's own SiLU product): codes equal off ties, so the two differ by the fp32
    bound and the one bf16 rounding of SGLang's stored output (2^-8 relative), plus a code step of each tie
    element of the down GEMM's input. Slots routed to -1 are zero."""
    g = torch.Generator().manual_seed(10 + k)
    spec, w13, w2 = _experts(fmt, g)
    x = _activations(6, fmt, g)
    p, ids = _routing(6, k, g)
    ids[1, 0] = -1
    _, ((x_in, h), (hidden, y)) = sglang_moe(x, p, ids, w13, w2, fmt)
    slots = ids.reshape(-1)
    token = torch.arange(slots.numel()) // k
    routed = slots >= 0
    expert = slots.clamp(min=0)
    w13f, w2f = w13.dequantize(torch.float32)[expert], w2.dequantize(torch.float32)[expert]
    assert torch.equal(x_in, x) and not h[~routed].any() and not y.reshape(-1, H)[~routed].any()
    xq = quantize_activation(x, spec)[token]
    h_ref = torch.einsum("sk,snk->sn", xq, w13f)
    h_bound = 8 * H * U * torch.einsum("sk,snk->sn", xq.abs(), w13f.abs()) + 2.0**-8 * h_ref.abs()
    assert ((h.float() - h_ref).abs() <= h_bound)[routed].all()
    hidden = hidden[: slots.numel()]
    hq = quantize_activation(hidden, spec)
    weight = p.reshape(-1, 1)
    y_ref = weight * torch.einsum("sk,snk->sn", hq, w2f)
    ties = _ties(hidden, spec.fmt).float() * torch.stack([_code_step(v.float(), spec.fmt) for v in hidden])
    y_bound = weight * (8 * I * U * torch.einsum("sk,snk->sn", hq.abs(), w2f.abs())
                        + torch.einsum("sk,snk->sn", ties, w2f.abs())) + 2.0**-8 * y_ref.abs()
    diff = (y.reshape(-1, H).float() - y_ref).abs()
    print(f"{fmt} k={k}: up GEMM max |diff| {(h.float() - h_ref).abs()[routed].max():.3g}, down GEMM "
          f"{diff[routed].max():.3g} ({int(_ties(hidden, spec.fmt)[routed].sum())} ties in its input)")
    assert (diff <= y_bound)[routed].all()


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("fmt", FORMATS_W8A8)
def test_sglang_experts_equal_the_emulation_within_the_bound(sglang_moe, fmt, k):
    """INT8 and FP8, top-k 1/2/8, another rank's experts (-1), an empty expert, a zero token: within
    fp32 bound + 4·2^-8·M + S (`_magnitude_and_step`). The tokens hold no tie (so the up GEMM's codes are the
    same on both sides), and the routed experts are the only ones computed (the bound is far below a slot)."""
    g = torch.Generator().manual_seed(k)
    spec, w13, w2 = _experts(fmt, g)
    x = _activations(6, fmt, g)
    p, ids = _routing(6, k, g)
    ids[1, 0] = -1
    assert not _ties(x, fmt).any() and not (ids == 3).any()
    out, _ = sglang_moe(x, p, ids, w13, w2, fmt)
    ref = experts_forward(x, p, ids, w13, w2, spec)
    magnitude, step = _magnitude_and_step(x, p, ids, w13, w2, spec)
    bound = (8 * (H + I) * U + 4 * 2.0**-8) * magnitude + step
    diff = (out.float() - ref.float()).abs()
    print(f"{fmt} k={k}: max |diff| {diff.max():.4g}, max |diff|/M {(diff / magnitude.clamp(min=1e-30)).max():.4g}, "
          f"max |diff|/bound {(diff / bound.clamp(min=1e-30)).max():.4g}, max bound/M "
          f"{(bound / magnitude.clamp(min=1e-30)).max():.4g}")
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.bfloat16 and (ref != 0).any()
    assert torch.equal(out[0], torch.zeros(H, dtype=out.dtype))
    assert (diff <= bound).all(), f"max error {diff.max():.3g}, bound there {bound.flatten()[diff.argmax()]:.3g}"
