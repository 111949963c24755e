import os
import sys

import pytest
import torch

# The tools the tests run (shellcheck, ray, qurl) are the ones the project's environment installs next to this
# interpreter, never copies a machine happens to have on its PATH: a fresh machine has none.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel path); the CPU path is tested elsewhere"
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _gloo_interface():
    """A trainer built in this process binds gloo to the interface towards its peer, loopback here, by setting
    GLOO_SOCKET_IFNAME (`qurl_mcore.transfer.bind_gloo_towards`); a later test's runs and namespace nodes would
    inherit it, and their groups across nodes would listen on loopback. Each test gets the variable back."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    yield
    if before is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = before


@pytest.fixture(scope="module")
def megatron_ws1():
    """Megatron's model-parallel state at world size 1 (gloo on CPU) for one module's in-process tests.

    Per module, not per session: an in-process PolicyTrainer starts and ends its own parallel state, which
    must not find this one still up (whatever order the modules run in)."""
    from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel

    init_parallel()
    yield
    destroy_parallel()


@pytest.fixture
def netns_nodes(tmp_path):
    """A factory of network-namespace nodes (tests/netns.py), always taken down after the test."""
    from tests.netns import Nodes, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"nodes of our own as network namespaces: {why}")
    made: list[Nodes] = []

    def make(count: int) -> Nodes:
        made.append(Nodes(count, tmp_path / "ray-state"))
        return made[-1]

    yield make
    for nodes in made:
        nodes.down()
