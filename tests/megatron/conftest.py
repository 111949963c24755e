import pytest
import torch

from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel


@pytest.fixture(scope="session")
def megatron_ws1():
    """Megatron's model-parallel state at world size 1 (gloo on CPU) for the in-process tests."""
    init_parallel()
    yield
    destroy_parallel()


@pytest.fixture
def reseed(megatron_ws1):
    """Reset torch's and Megatron's RNGs so two models built after it get the same initial weights."""
    from megatron.core import tensor_parallel

    def _reseed(seed: int = 1234) -> None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return _reseed
