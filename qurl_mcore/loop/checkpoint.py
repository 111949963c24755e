"""Atomic checkpoints: a step's files are written into `step_N.partial/` and the directory is renamed to
`step_N/` only once every rank's file and the metadata are on disk, so a crash at any moment leaves either the
previous checkpoint or the new one, never a half-written one that resuming would pick up.

Layout: ROOT/step_00000012/{meta.json, rank0.pt, rank1.pt, ...}
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"step_(\d{8})$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def write_rank(root: str | Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Save one rank's state (model/optimizer shards, data position, ...) into the step's partial directory."""
    partial = step_dir(root, step).with_suffix(".partial")
    partial.mkdir(parents=True, exist_ok=True)
    tmp = partial / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, partial / f"rank{rank}.pt")


def finalize(root: str | Path, step: int, world_size: int, meta: dict[str, Any], keep: int = 2) -> Path:
    """After every rank has called `write_rank` (the caller's barrier): write meta.json, publish the directory
    with one rename, and delete all but the newest `keep` checkpoints."""
    partial = step_dir(root, step).with_suffix(".partial")
    missing = [r for r in range(world_size) if not (partial / f"rank{r}.pt").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint step {step} lacks the files of ranks {missing}; was every rank saved?")
    (partial / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size, **meta}, indent=2))
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoints, oldest first (partial directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.search(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.search(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_rank(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, this rank's state) of a published checkpoint."""
    meta = json.loads((path / "meta.json").read_text())
    state = torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    return meta, state


def rng_state() -> dict[str, Any]:
    """Every random generator a step draws from, so a resumed run continues the same random sequence."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class StopRequest:
    """Turns SIGTERM (Slurm preemption, the job script's time-limit warning) into a flag the loop checks between
    steps, so it checkpoints and exits instead of dying mid-step."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.requested = False
        self.signal_name = ""
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
