import numpy as np
import pytest
import torch

from qurl_mcore.megatron.cpu_compat import FIXES, apply_cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fixes apply only without CUDA")


def test_all_six_fixes_apply_once():
    names = apply_cpu_compat()
    assert names == tuple(name for name, _ in FIXES) and len(names) == 6
    assert apply_cpu_compat() == names  # idempotent


def test_fixes_replace_the_cuda_assumptions():
    apply_cpu_compat()
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert torch.device(torch.cuda.current_device()).type == "cpu"
    assert moe_utils.te_general_gemm is None
    split_sizes = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(split_sizes, np.ndarray) and split_sizes.tolist() == [3, 1]
    assert torch.equal(fused_softmax.get_default_causal_mask(3),
                       torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool))
    swa = fused_softmax.get_sliding_window_causal_mask(4, 4, (1, 0))  # each query sees itself and one back
    assert swa.sum(1).tolist() == [3, 2, 2, 2]
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream.record_event().synchronize()
    assert isinstance(torch.cuda.Stream, type)  # still a class: transformers annotates with it


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
