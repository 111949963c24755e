"""Temporary copies of installed package files, so that tests apply pinned patch sets without touching the venv."""
from __future__ import annotations

import shutil
from pathlib import Path

from qurl_mcore.patching import PatchSet


def installed_copy(target: str, root: Path) -> PatchSet:
    """The installed files that `target`'s pinned patch set touches, copied under `root` (a stand-in for
    site-packages); returns the set bound to the copy, nothing applied yet."""
    installed = PatchSet.installed(target)
    for rel in sorted({fp.path for file_patches in installed.patches.values() for fp in file_patches}):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed.root / rel, root / rel)
    return PatchSet.load(target, root, installed.version)
