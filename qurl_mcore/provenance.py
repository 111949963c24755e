"""Which code a run ran: the git commit of the qurl-mcore tree that Python imports, and whether that tree had
uncommitted changes: to tracked files, or new files in the package (other untracked files, such as a study's own
run directories, do not count).

Outside a git checkout (an installed wheel) there is no commit: the package version stands in for it.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import qurl_mcore

#: the tree whose code runs: the directory above the imported package
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CodeVersion:
    """`commit` (None outside a git checkout) and `dirty` (None when unknown) of the imported tree."""

    commit: str | None
    dirty: bool | None
    version: str = qurl_mcore.__version__

    def label(self) -> str:
        """What a report prints: the short commit, "+dirty" when the tree had changes, or the package version."""
        if self.commit is None:
            return f"qurl-mcore {self.version} (no git commit)"
        return self.commit[:10] + ("+dirty" if self.dirty else "")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None
    return done.stdout if done.returncode == 0 else None


def code_version(root: Path = ROOT) -> CodeVersion:
    """The commit of `root` and whether its tracked files differ from it."""
    top = _git(root, "rev-parse", "--show-toplevel")
    # a package installed into a virtual environment that lies inside some checkout is not that checkout's code
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return CodeVersion(None, None)
    head = _git(root, "rev-parse", "HEAD")
    if head is None:  # a repository without a commit yet
        return CodeVersion(None, None)
    status = _git(root, "status", "--porcelain")
    if status is None:
        return CodeVersion(head.strip(), None)
    changed = [line for line in status.splitlines() if not line.startswith("??") or line[3:].startswith("qurl_mcore/")]
    return CodeVersion(head.strip(), bool(changed))
