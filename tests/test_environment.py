"""The test environment is the project's own: what the tests run comes from requirements/, not the machine."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name as _canonical

REQUIREMENTS = Path(__file__).parents[1] / "requirements"


def test_tools_come_from_the_projects_environment():
    """A fresh machine has no shellcheck or ray on its PATH: the ones the tests call must be those that
    launch/setup_env.sh installed beside this interpreter (requirements/test.txt, requirements/cpu.txt)."""
    here = Path(sys.executable).parent
    for tool in ("shellcheck", "ray", "qurl"):
        found = shutil.which(tool)
        assert found is not None and Path(found).parent == here, f"{tool}: {found}"


def test_megatron_adapter_does_not_import_the_rollout_client():
    """megatron/ and rollout/ share qurl_mcore/transfer.py; neither reaches into the other."""
    import ast

    root = Path(__file__).parents[1] / "qurl_mcore"
    for package, other in (("megatron", "rollout"), ("rollout", "megatron")):
        for path in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith(f"qurl_mcore.{other}"), f"{path.name} imports {node.module}"
                    assert not (node.level == 2 and node.module.startswith(other)), f"{path.name}: {node.module}"


@pytest.mark.slow
def test_the_gpu_requirement_set_resolves(tmp_path):
    """requirements/gpu.txt is one set of binary wheels pip can install: resolved against the registry without
    installing or building anything (an isolated build of TE's torch extension would pull GBs of CUDA torch)."""
    import json
    import subprocess

    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--only-binary", ":all:", "--report", str(report), "-r", str(REQUIREMENTS / "gpu.txt")],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {_canonical(item["metadata"]["name"]): item["metadata"]["version"]
           for item in json.loads(report.read_text())["install"]}
    want = {"torch": "2.14.1", "sglang": "0.5.23", "sglang-kernel": "0.4.10", "transformers": "5.19.0",
            "megatron-core": "0.16.1", "transformer-engine": "2.11.0", "transformer-engine-cu13": "2.11.0",
            "ray": "2.60.0"}
    assert {k: got.get(k) for k in want} == want


def test_the_te_extension_matches_the_gpu_set():
    """Step 2 (requirements/gpu-te.txt) builds TE's torch extension at the version of step 1's TE core."""
    from packaging.requirements import Requirement

    def pins(name: str) -> dict[str, str]:
        reqs = [Requirement(line) for line in (REQUIREMENTS / name).read_text().splitlines()
                if line.strip() and not line.startswith("#")]
        return {_canonical(r.name): str(r.specifier) for r in reqs}

    assert pins("gpu-te.txt") == {"transformer-engine": pins("gpu.txt")["transformer-engine"]} == {
        "transformer-engine": "==2.11.0"}
