import numpy as np
import pytest
import torch

from qurl_mcore.megatron.cpu_compat import FIXES, apply_cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fixes apply only without CUDA")


def test_every_fix_applies_once():
    names = apply_cpu_compat()
    assert names == tuple(name for name, _ in FIXES) and len(names) == 8
    assert apply_cpu_compat() == names  # idempotent


def test_cuda_devices_mean_the_cpu_and_clipping_needs_no_cuda_tensors():
    """What megatron's modules allocate with device="cuda" lands on the CPU, while torch itself is untouched
    elsewhere; gradient clipping scales by max_norm / (total_norm + 1e-6) as Megatron's does."""
    apply_cpu_compat()
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mutils

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    norm, _ = mutils.local_multi_tensor_l2_norm(0, None, [[torch.full((4,), 2.0)]], False)
    assert norm.device.type == "cpu" and norm.item() == 4.0
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # anywhere else, CUDA still means CUDA
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    clip_grads.clip_grad_by_total_norm_fp32([p], 1.0, 6.0)
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))


def test_fixes_replace_the_cuda_assumptions():
    apply_cpu_compat()
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert torch.device(moe_utils.torch.cuda.current_device()).type == "cpu"
    assert moe_utils.te_general_gemm is None
    import megatron.core.transformer.multi_latent_attention as mla

    assert mla.HAVE_TE is False  # no Transformer Engine on this machine
    split_sizes = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(split_sizes, np.ndarray) and split_sizes.tolist() == [3, 1]
    assert torch.equal(fused_softmax.get_default_causal_mask(3),
                       torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool))
    swa = fused_softmax.get_sliding_window_causal_mask(4, 4, (1, 0))  # each query sees itself and one back
    assert swa.sum(1).tolist() == [3, 2, 2, 2]
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream.record_event().synchronize()
    assert isinstance(torch.cuda.Stream, type)  # still a class: transformers annotates with it


def test_revert_puts_back_everything_the_fixes_replaced():
    import logging

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from qurl_mcore.megatron.cpu_compat import revert_cpu_compat

    revert_cpu_compat()
    watched = [(torch.cuda, n) for n in ("current_device", "current_stream", "stream", "synchronize", "manual_seed",
                                         "get_rng_state")]
    watched += [(schedules, "torch"), (clip_grads, "clip_grad_by_total_norm_fp32"), (mrandom, "_get_cuda_rng_state"),
                (mrandom.CudaRNGStatesTracker, "add"), (moe_utils, "te_general_gemm"),
                (MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream")]
    before = [vars(owner).get(name, "absent") for owner, name in watched]
    level = logging.getLogger(mrandom.__name__).level
    try:
        apply_cpu_compat()
        assert schedules.torch is not torch and schedules.torch.cuda.synchronize is not before[3]
    finally:
        revert_cpu_compat()
    assert [vars(owner).get(name, "absent") for owner, name in watched] == before
    assert logging.getLogger(mrandom.__name__).level == level
    assert apply_cpu_compat() == tuple(name for name, _ in FIXES)  # and they apply again


def test_torch_cuda_stays_torchs_own_while_megatron_runs_on_the_cpu():
    """Only megatron's modules see the CPU meanings of torch.cuda's functions, also a module megatron imports
    while its groups are up; every other caller in the process (SGLang colocated, user code) gets torch's."""
    import importlib
    import sys

    import torch.distributed as dist

    from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel

    names = ("current_device", "current_stream", "stream", "synchronize", "manual_seed", "get_rng_state")
    own = {name: vars(torch.cuda)[name] for name in names}
    late = "megatron.core.inference.text_generation_server.endpoints.common"  # broadcasts on current_device()
    sys.modules.pop(late, None)
    init_parallel()
    try:
        assert {name: getattr(torch.cuda, name) for name in names} == own and sys.modules["torch"] is torch
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()  # CPU torch's own answer
        endpoints = importlib.import_module(late)
        endpoints.send_do_generate()  # megatron's code: a tensor on torch.cuda.current_device(), broadcast
        assert endpoints.torch is not torch and dist.is_initialized()
        assert type(endpoints.__loader__) is type(sys.modules["megatron.core.utils"].__loader__)
    finally:
        destroy_parallel()
    assert endpoints.torch is torch


def test_megatron_seeding_leaves_the_cpu_generator_alone():
    """On a GPU, init_parallel seeds the CUDA generators; on the CPU, whose "CUDA" generator states the tracker
    makes from the CPU one, the CPU generator's stream goes on as if nothing happened."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel

    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    init_parallel(seed=1234)
    try:
        assert torch.equal(torch.rand(4), expected)
        with get_cuda_rng_tracker().fork():  # the tracked state is the CPU generator seeded by 1234 + 2718
            tracked = torch.rand(4)
    finally:
        destroy_parallel()
    assert torch.equal(tracked, torch.rand(4, generator=torch.Generator().manual_seed(1234 + 2718)))


# after the tests that start and stop Megatron themselves: this module's fixture keeps it up to the end
def test_rng_tracker_forks_the_cpu_generator(megatron_ws1):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.manual_seed(5)
    outside = torch.rand(3)
    torch.manual_seed(5)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    assert not torch.equal(inside, outside)  # the tracked state, not the default one
    assert torch.equal(after, outside)  # and the default stream is restored after the fork

