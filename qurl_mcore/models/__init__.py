"""Small real models that ship inside packages, and tiny random ones, for tests and demos. Nothing is
downloaded at run time; converted checkpoints are cached under `cache_dir()` (never in git)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .registry import ARCHITECTURES  # the HF model types qurl-mcore trains and rolls out, each with its table


def cache_dir() -> Path:
    """$QURL_CACHE_DIR, else ~/.cache/qurl-mcore; created on first use."""
    path = Path(os.environ.get("QURL_CACHE_DIR") or Path.home() / ".cache" / "qurl-mcore")
    path.mkdir(parents=True, exist_ok=True)
    return path


def publish(tmp: Path, out: Path, replace: bool = False) -> Path:
    """Make the finished directory `tmp` the cache entry `out` in one rename, so no reader ever sees half of
    it. Makers of the same entry may race (two runs or test workers sharing a cache): their contents are the
    same, the first rename wins and a later one keeps the winner's. `replace` (a refresh) moves an existing
    `out` aside first, and deletes it only once the new one is in place."""
    old = None
    if replace and out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-old-"))
        out.rename(old / out.name)
    try:
        tmp.rename(out)
    except OSError:
        if not out.is_dir():  # not a lost race: out is a file, or the cache's disk failed
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def resolve_model_path(path: str) -> Path:
    """`model.path` as an HF checkpoint directory; "smollm2" is the packaged SmolLM2-135M-Instruct,
    "smollm2-moe" that model upcycled into a 4-expert Mixtral (models/upcycle.py) and "tiny-<arch>" a tiny
    random model (tests)."""
    if path == "smollm2":
        # lazy: loads torch; `qurl --help` imports this package
        from qurl_mcore.models.smollm2 import hf_checkpoint

        return hf_checkpoint()
    if path == "smollm2-moe":
        # lazy: loads torch; `qurl --help` imports this package
        from qurl_mcore.models.upcycle import smollm2_moe_checkpoint

        return smollm2_moe_checkpoint()
    if path.startswith("tiny-"):
        # lazy: loads torch; `qurl --help` imports this package
        from qurl_mcore.models.tiny import tiny_checkpoint

        return tiny_checkpoint(path.removeprefix("tiny-"))
    out = Path(path)
    if not (out / "config.json").is_file():
        what = "no config.json there" if out.exists() else "no such directory"
        raise FileNotFoundError(f"{path}: {what}; give an HF checkpoint directory, 'smollm2', 'smollm2-moe', or "
                                f"'tiny-<{'|'.join(ARCHITECTURES)}>'")
    return out
