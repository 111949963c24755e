"""The test environment is the project's own: what the tests run comes from requirements/, not the machine."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


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
