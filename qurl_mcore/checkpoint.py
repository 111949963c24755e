"""Checkpoints that are atomic, checksummed and written where the state lives.

The trainer ranks write their state into `step_N.partial/` in their own processes (no state travels through
the driver), in one of two formats (`FORMATS`, meta.json's "format"): `torch_dist`, Megatron-Core's
distributed checkpoint in `step_N/trainer/` (megatron/dist_checkpoint.py: every rank writes its slices of
every global tensor, so another parallel layout can load it), or `torch`, one `torch.save` file per rank
(`write_file`: only the layout that wrote it can load it). Each rank hashes the files it wrote
(`write_file` as it goes, `hash_files` after Megatron wrote them); the driver writes its own file, then
`finalize` records every file's size and SHA-256 in meta.json and publishes the directory with one rename. A crash at
any moment leaves the previous checkpoint or the new one, never a half-written one that resuming would pick.

A checkpoint can still be damaged afterwards (a full disk, a truncated copy, an edit): `verify` re-reads
every file against meta.json, resuming takes the newest checkpoint that verifies (`latest_valid`, naming the
damaged ones), and `finalize` deletes an older checkpoint only once its successor has verified.

Layout: ROOT/step_00000012/{meta.json, driver.pt, trainer/{metadata.json, common.pt, .metadata,
__0_0.distcp, __1_0.distcp, ...}} (torch_dist) or ROOT/step_00000012/{meta.json, driver.pt, rank0.pt, ...}
(torch).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"step_(\d{8})$")
_CHUNK = 8 << 20


#: the trainer's state formats: whether a parallel layout other than the writer's can load it
FORMATS = {"torch_dist": True, "torch": False}
#: the directory of a torch_dist checkpoint that holds the trainer's distributed checkpoint
TRAINER_DIR = "trainer"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: str | Path, step: int) -> Path:
    """Where step `step`'s files are written before `finalize` publishes them."""
    return step_dir(root, step).with_suffix(".partial")


def format_of(meta: dict[str, Any]) -> str:
    """The trainer state's format of a checkpoint (its meta.json): one of FORMATS ("torch" when not recorded)."""
    return meta.get("format", "torch")


class _HashingWriter:
    """A binary file that hashes what is written to it (so a checkpoint is read back only to verify it)."""

    def __init__(self, path: Path):
        self.file, self.sha, self.size = open(path, "wb"), hashlib.sha256(), 0
        self.error: OSError | None = None  # the file's own error, which torch.save may report as its own

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:
            self.error = err
            raise


#: free bytes under which a failed write is taken for a full disk whatever its error says (Megatron's
#: distributed save reports a short write as "unexpected pos", without the ENOSPC underneath)
NEARLY_FULL_BYTES = 16 << 20


def out_of_space(err: BaseException | None, where: str | Path) -> bool:
    """Whether a write under `where` failed with `err` because the disk is full: ENOSPC in the error or what
    caused it, or hardly any space left there."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    try:
        return shutil.disk_usage(where).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def no_space(partial: Path) -> OSError:
    """The error of a checkpoint write into `partial` that filled the disk (its files removed by the caller)."""
    return OSError(errno.ENOSPC, f"no space left on device for {partial} (its partial files are removed); free "
                                 "space there or set checkpoint.dir to another disk")


def check_space(root: str | Path) -> None:
    """Before a save: OSError (ENOSPC) when `root` has less free space than its newest checkpoint took, which
    the next one will take again."""
    newest = latest_checkpoint(root)
    if newest is None:
        return
    needed = sum(record["bytes"] for record in read_meta(newest)["files"])
    free = shutil.disk_usage(root).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{root} has {free / 2**20:.0f} MiB free, and a checkpoint takes "
                                    f"{needed / 2**20:.0f} MiB ({newest.name}); free space there or set "
                                    "checkpoint.dir to another disk")


def write_file(root: str | Path, step: int, name: str, state: dict[str, Any]) -> dict[str, Any]:
    """Save `state` as file `name` of step `step`'s partial checkpoint (durably: fsync'd before it takes its
    name). Returns its record for `finalize`: {"file", "bytes", "sha256"}."""
    partial = partial_dir(root, step)
    partial.mkdir(parents=True, exist_ok=True)
    tmp = partial / f"{name}.tmp"
    writer = _HashingWriter(tmp)
    try:
        torch.save(state, writer)
        writer.flush()
        writer.file.close()
    except BaseException as err:
        with contextlib.suppress(OSError):  # what is still buffered cannot be written either
            writer.file.close()
        full = out_of_space(writer.error or err, partial)
        tmp.unlink(missing_ok=True)
        if full:
            raise no_space(partial / name) from None
        raise
    os.replace(tmp, partial / name)
    return {"file": name, "bytes": writer.size, "sha256": writer.sha.hexdigest()}


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def hash_files(directory: str | Path, names: list[str]) -> list[dict[str, Any]]:
    """The records for `finalize` of files `names` (paths relative to `directory`, a step's partial
    directory) that something else wrote: {"file", "bytes", "sha256"} each, fsync'd first."""
    records = []
    for name in names:
        path = Path(directory) / name
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        records.append({"file": name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
    return records


def verify(path: str | Path) -> str | None:
    """None if checkpoint directory `path` is whole, else what is wrong with it."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"meta.json unreadable ({type(err).__name__}: {err})"
    for record in files:
        f = path / record["file"]
        if not f.is_file():
            return f"{record['file']} is missing"
        if f.stat().st_size != record["bytes"]:
            return f"{record['file']} has {f.stat().st_size} bytes, {record['bytes']} were written"
        if _sha256(f) != record["sha256"]:
            return f"{record['file']} does not match its checksum"
    return None


def finalize(root: str | Path, step: int, files: list[dict[str, Any]], meta: dict[str, Any], keep: int = 2) -> Path:
    """After every file of the step was written (`write_file`; the caller's barrier): write meta.json with
    the files' records, publish the directory with one rename, verify it, and only then delete older
    checkpoints beyond the newest `keep` valid ones."""
    partial = partial_dir(root, step)
    missing = [r["file"] for r in files if not (partial / r["file"]).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint step {step} lacks {missing}; was every rank saved?")
    meta_path = partial / "meta.json"
    meta_path.write_text(json.dumps({"step": step, **meta, "files": files}, indent=2))
    with open(meta_path) as f:
        os.fsync(f.fileno())
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    problem = verify(final)
    if problem is not None:
        raise RuntimeError(f"checkpoint {final} did not verify after writing: {problem}; older checkpoints kept")
    valid = [p for p in list_checkpoints(root) if p == final or verify(p) is None]
    for old in valid[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoint directories, oldest first (partial directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.search(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.search(p.name).group(1)))


def latest_valid(root: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies or None, [(newer damaged checkpoint, its problem), ...])."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint that verifies."""
    return latest_valid(root)[0]


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def read_file(path: str | Path, name: str) -> dict[str, Any]:
    """One file's state of a published checkpoint."""
    return torch.load(Path(path) / name, map_location="cpu", weights_only=False)


def model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's tensors of published checkpoint `path`, read in this process (no process group): every
    global tensor whole, by Megatron's name (torch_dist), or trainer rank 0's by state-dict name (torch)."""
    if format_of(read_meta(path)) == "torch":
        state = read_file(path, rank_file(0))["model"]
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(path) / TRAINER_DIR))
    found = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in found.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def tensor_mismatch(saved: dict[str, Any], current: dict[str, Any], shown: int = 2) -> str | None:
    """How a checkpoint's state dict `saved` differs from a model's `current` one, in one line: the tensors
    only the model has, those only the checkpoint has, and those of another shape (the first `shown` of each,
    with the count); None when names and shapes agree."""
    def shape(value) -> list[int] | None:
        return list(value.shape) if isinstance(value, torch.Tensor) else None

    def first(kind: str, items: list[str]) -> str:
        more = f" and {len(items) - shown} more" if len(items) > shown else ""
        return f"{len(items)} {kind}: " + ", ".join(items[:shown]) + more

    kinds = [("only in this run's model", [k for k in current if k not in saved]),
             ("only in the checkpoint", [k for k in saved if k not in current]),
             ("of another shape", [f"{k} {shape(saved[k])} (the model's: {shape(current[k])})" for k in current
                                   if k in saved and shape(saved[k]) != shape(current[k])])]
    found = [first(kind, items) for kind, items in kinds if items]
    return "; ".join(found) or None


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """Every random generator a step draws from, so a resumed run continues the same random sequence."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
