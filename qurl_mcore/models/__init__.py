"""Small real models that ship inside packages, and tiny random ones, for tests and demos. Nothing is
downloaded at run time; converted checkpoints are cached under `cache_dir()` (never in git)."""
from __future__ import annotations

import os
from pathlib import Path

from .registry import ARCHITECTURES  # the HF model types qurl-mcore trains and rolls out, each with its table


def cache_dir() -> Path:
    """$QURL_CACHE_DIR, else ~/.cache/qurl-mcore; created on first use."""
    path = Path(os.environ.get("QURL_CACHE_DIR") or Path.home() / ".cache" / "qurl-mcore")
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model_path(path: str) -> Path:
    """`model.path` as an HF checkpoint directory; "smollm2" is the packaged SmolLM2-135M-Instruct and
    "tiny-<arch>" a tiny random model (tests)."""
    if path == "smollm2":
        # lazy: loads torch; `qurl --help` imports this package
        from qurl_mcore.models.smollm2 import hf_checkpoint

        return hf_checkpoint()
    if path.startswith("tiny-"):
        # lazy: loads torch; `qurl --help` imports this package
        from qurl_mcore.models.tiny import tiny_checkpoint

        return tiny_checkpoint(path.removeprefix("tiny-"))
    out = Path(path)
    if not (out / "config.json").is_file():
        what = "no config.json there" if out.exists() else "no such directory"
        raise FileNotFoundError(f"{path}: {what}; give an HF checkpoint directory, 'smollm2', or "
                                f"'tiny-<{'|'.join(ARCHITECTURES)}>'")
    return out
