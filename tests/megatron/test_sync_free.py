"""The device-side stand-ins for Megatron's gradient-norm fallback and unfused token permutation
(`qurl_mcore.megatron.sync_free`): Megatron's numbers, with no value read back to the host."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.megatron import sync_free
from qurl_mcore.stack import Stack
from tests.conftest import requires_cuda
from tests.host_syncs import HostReads


@pytest.fixture(autouse=True)
def megatron(megatron_ws1):
    """Megatron's parallel state (and with it this device's fixes: its fallback allocates on "cuda")."""


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 4, (torch.bfloat16,) * 4,
                                    (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)])
def test_grad_norm_is_megatrons_fallback_exactly_and_reads_nothing_back(dtypes):
    """Equal to the last bit (the CPU's foreach norm is the per-tensor norm; the norms stack in the dtype they
    promote to, as Megatron's torch.tensor of them does), where Megatron's fallback reads every norm back."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(dtype) * scale
               for shape, dtype, scale in zip([(1000,), (37, 5), (3,), (64, 96)], dtypes, (1e-3, 1.0, 7.0, 1e2))]
    noop = torch.zeros(1, dtype=torch.int)
    with HostReads() as reads:
        ours, per_tensor = sync_free.multi_tensor_l2_norm(2048 * 32, noop, [tensors], False)
    assert reads.count == 0 and per_tensor is None
    with HostReads() as megatron_reads:
        megatron, _ = local_multi_tensor_l2_norm(2048 * 32, noop, [tensors], False)
    assert megatron_reads.count >= 1  # its float() of the total (its torch.tensor of the norms reads each too,
    # below the dispatcher: the façade's trace counts those)
    assert ours.dtype == megatron.dtype == torch.float32 and ours.shape == megatron.shape == (1,)
    assert torch.equal(ours, megatron)
    closed_form = torch.cat([t.double().flatten() for t in tensors]).norm().item()
    bound = 2 ** -7 if torch.bfloat16 in dtypes else 1e-6  # a bf16 norm's rounding, else fp32 summation's
    assert abs(ours.item() / closed_form - 1) < bound


def _routing(tokens: int, experts: int, topk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=gen).softmax(-1)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    return routing_map, (scores * routing_map).requires_grad_(), torch.randn(tokens, 8, generator=gen,
                                                                              requires_grad=True)


@pytest.mark.parametrize("tokens,experts,topk", [(64, 16, 4), (37, 8, 1), (5, 128, 8)])
def test_dropless_permute_is_megatrons_and_reads_nothing_back(tokens, experts, topk):
    """Same permuted tokens, probabilities and token indices as Megatron's masked_select permutation, and the
    same gradients through them, with no host read where Megatron's makes two."""
    from megatron.core.transformer.moe.moe_utils import permute

    routing_map, probs, x = _routing(tokens, experts, topk, seed=tokens)
    with HostReads() as reads:
        ours = sync_free.permute(x, routing_map, probs=probs, num_out_tokens=tokens * topk)
    with HostReads() as megatron_reads:
        megatron = permute(x, routing_map, probs=probs, num_out_tokens=tokens * topk)
    assert reads.count == 0 and megatron_reads.count == 2
    assert all(torch.equal(a, b) for a, b in zip(ours, megatron))
    weights = torch.randn(tokens * topk, 8)
    grads = [torch.autograd.grad(((out * weights).sum(1) * p).sum(), (x, probs)) for out, p, _ in (ours, megatron)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_permute_without_a_static_size_is_megatrons_own():
    """Where the routed tokens' number is not a host int (router padding, capacity), Megatron's code runs."""
    from megatron.core.transformer.moe.moe_utils import permute

    routing_map, probs, x = _routing(16, 8, 2, seed=1)
    with HostReads() as reads:
        ours = sync_free.permute(x, routing_map, probs=probs, num_out_tokens=routing_map.sum())
    assert reads.count == 2  # Megatron's masked_select
    assert all(torch.equal(a, b) for a, b in zip(ours, permute(x, routing_map, probs=probs)))


def test_install_puts_them_where_megatron_calls_them():
    """Megatron's gradient norm (get_grad_norm_fp32) runs the device-side kernel on a stack without Transformer
    Engine or apex, and reads the result once; the alltoall dispatcher calls the static-size permute."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    assert sync_free.install(Stack(cuda=False, te=False, apex=False)) == ("permute", "multi_tensor_l2_norm")
    assert token_dispatcher.permute is sync_free.permute
    assert clip_grads.l2_norm_impl is sync_free.multi_tensor_l2_norm
    grads = [torch.full((4,), 2.0), torch.full((9,), 1.0)]  # norm √(16 + 9) = 5
    with HostReads() as reads:
        norm = clip_grads.get_grad_norm_fp32(grads)
    assert norm == pytest.approx(5.0) and reads.count == 1


@pytest.mark.gpu
@requires_cuda
def test_on_cuda_neither_synchronizes_and_both_keep_megatrons_numbers():
    """torch's sync debug mode raises on any synchronizing call: neither stand-in makes one. The permutation
    is Megatron's element for element; the norm within fp32 summation-order rounding of Megatron's (on CUDA,
    `_foreach_norm` sums a tensor's squares in another order than `torch.norm`)."""
    from megatron.core.transformer.moe.moe_utils import permute
    from megatron.core.utils import local_multi_tensor_l2_norm

    routing_map, probs, x = (t.cuda() for t in _routing(4096, 128, 8, seed=0))
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).cuda() for shape in [(4096, 2048), (128, 768, 2048), (7,)]]
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = sync_free.permute(x, routing_map, probs=probs, num_out_tokens=4096 * 8)
        norm, _ = sync_free.multi_tensor_l2_norm(2048 * 32, noop, [tensors], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(ours, permute(x, routing_map, probs=probs, num_out_tokens=4096 * 8)))
    megatron, _ = local_multi_tensor_l2_norm(2048 * 32, noop, [tensors], False)
    assert torch.allclose(norm, megatron, rtol=1e-5, atol=0)
