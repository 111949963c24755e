import pytest
import torch


@pytest.fixture
def reseed(megatron_ws1):
    """Reset torch's and Megatron's RNGs so two models built after it get the same initial weights."""
    from megatron.core import tensor_parallel

    def _reseed(seed: int = 1234) -> None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return _reseed
