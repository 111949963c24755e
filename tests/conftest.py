import os
import sys
from pathlib import Path

import pytest
import torch

# The tools the tests run (shellcheck, ray, qurl) are the ones the project's environment installs next to this
# interpreter, never copies a machine happens to have on its PATH: a fresh machine has none.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel path); the CPU path is tested elsewhere"
)


def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). A file's tests share
    one group, so they stay on one worker and a module fixture (a loop run several tests read) runs once.
    Files that hold something the whole machine shares (network namespaces at fixed addresses, a Slurm
    controller: their tests use `netns_nodes` or are marked `machine`) share one group, so two never run
    at once; it goes first, being the longest."""
    machine = {item.path for item in items
               if "netns_nodes" in item.fixturenames or item.get_closest_marker("machine")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("machine" if item.path in machine else
                                                 str(Path(item.path).relative_to(config.rootpath))))
    items.sort(key=lambda item: item.path not in machine)  # stable: each file stays in one piece


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
