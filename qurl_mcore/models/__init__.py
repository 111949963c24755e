"""Small real models that ship inside packages, and tiny random ones, for tests and demos. Nothing is
downloaded at run time; converted checkpoints are cached under `cache_dir()` (never in git)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$QURL_CACHE_DIR, else ~/.cache/qurl-mcore; created on first use."""
    path = Path(os.environ.get("QURL_CACHE_DIR") or Path.home() / ".cache" / "qurl-mcore")
    path.mkdir(parents=True, exist_ok=True)
    return path
