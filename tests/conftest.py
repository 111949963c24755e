import pytest
import torch

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel path); the CPU path is tested elsewhere"
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
