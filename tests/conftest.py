import os
import sys
from pathlib import Path

import pytest

# Two pytest-xdist workers share two cores, and each test's engines and trainers add threads of their own: an
# OpenMP thread that spins while it waits takes the core another process needs (tests/sglang on two workers:
# 259 s spinning, 201 s passive). Set before torch loads OpenMP; every process a test starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# The tools the tests run (shellcheck, ray, qurl) are the ones the project's environment installs next to this
# interpreter, never copies a machine happens to have on its PATH: a fresh machine has none.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel path); the CPU path is tested elsewhere"
)


#: test files that hold something the whole machine shares (network namespaces and their Ray clusters, the one
#: Slurm controller, Ray heads started by the launch scripts): under pytest-xdist they share one worker, one at a
#: time. A file whose tests use `netns_nodes` or are marked `machine` must be here (checked at collection).
MACHINE_FILES = ("tests/loop/test_e2e.py", "tests/loop/test_faults_multinode.py", "tests/launch/test_slurm_job.py",
                 "tests/launch/test_slurm_multinode.py", "tests/launch/test_ray_cluster.py", "tests/test_transfer.py")


def pytest_collection_modifyitems(config, items):
    """MACHINE_FILES first (the longest unit of the suite: the other worker takes the rest meanwhile), then
    the files with slow tests, then the fast files, whose many short units even out the two workers' ends;
    each file in one piece. A file that shares the machine but is not in MACHINE_FILES is an error."""
    rel = {item: Path(item.path).relative_to(config.rootpath).as_posix() for item in items}
    missing = sorted({rel[item] for item in items if rel[item] not in MACHINE_FILES and (
        "netns_nodes" in item.fixturenames or item.get_closest_marker("machine"))})
    if missing:
        raise pytest.UsageError(f"{missing} share the machine (netns_nodes, or marked machine): add them to "
                                "tests/conftest.py's MACHINE_FILES")
    slow = {rel[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (rel[item] not in MACHINE_FILES, rel[item] not in slow))  # stable: files whole


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the suite on two pytest-xdist workers: a file's tests on one worker, so a module fixture
    (a loop run several tests read) runs once; MACHINE_FILES as one unit. (xdist's loadgroup would do this
    from markers, but pytest 9 ignores the test-id suffix it writes.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "machine" if path in MACHINE_FILES else path

    return ByFile(config, log)


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
