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
