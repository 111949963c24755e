"""`qurl patch apply|check|revert|status --target <one of TARGETS>`: pinned source patch sets for installed
packages.

A patch set is `patches/<target>/<version>/*.patch` (unified diffs relative to site-packages, applied in name
order) with a README saying why each patch exists. The tool refuses an installed version other than a pinned
one, applies each patch at most once, and records what it changed in `<package>/.qurl-patches.json`: per
patch, the sha256 of every file before and after. `revert` takes the patches back out in reverse order and
checks that every file hashes exactly as before; a file changed by anything else is reported, never
overwritten.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .diff import FilePatch, PatchError, apply_text, parse

MANIFEST = ".qurl-patches.json"


@dataclass(frozen=True)
class Target:
    """A patchable installed package: its distribution name and top-level import package directory."""

    name: str
    dist: str
    package: str  # path of the package directory relative to site-packages

    def installed(self) -> tuple[Path, str]:
        """(site-packages root holding the package, installed version)."""
        try:
            dist = metadata.distribution(self.dist)
        except metadata.PackageNotFoundError:
            raise PatchError(f"{self.dist} is not installed in this environment ({Path(sys.executable).parent}); "
                             f"run qurl patch with the Python environment that runs {self.dist}") from None
        root = Path(dist.locate_file(""))
        if not (root / self.package).is_dir():
            raise PatchError(f"{self.dist} is installed but {root / self.package} is missing")
        return root, dist.version


TARGETS = {  # the one list of patchable packages: the CLI's --target choices and patches/<name>/
    "sglang": Target("sglang", "sglang", "sglang"),
    "megatron": Target("megatron", "megatron-core", "megatron/core"),
    "verl": Target("verl", "verl", "verl"),  # a verl environment's, not ours: verl is in our test environment only
}


def default_patch_dir() -> Path:
    """The repository's patches/ directory (qurl-mcore is installed editable from the checkout)."""
    return Path(__file__).resolve().parents[2] / "patches"


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:  # keep line endings exactly as they are
        return f.read()


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class PatchSet:
    """The pinned patches of one target at one version, bound to an installed copy at `root`."""

    target: Target
    version: str
    root: Path
    patches: dict[str, list[FilePatch]]

    @classmethod
    def load(cls, target: str, root: Path, version: str, patch_dir: Path | None = None) -> "PatchSet":
        if target not in TARGETS:
            raise PatchError(f"unknown patch target {target!r}; use one of {sorted(TARGETS)}")
        base = (patch_dir or default_patch_dir()) / target
        pinned = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
        if version not in pinned:
            dist = TARGETS[target].dist
            raise PatchError(
                f"{dist} {version} is installed, but the patch sets in {base} are pinned to "
                f"{', '.join(pinned) or 'no version'}: install {dist}=={pinned[-1] if pinned else '?'} "
                f"(bash launch/setup_env.sh) or port the patches to {version} in {base / version}/"
            )
        files = sorted((base / version).glob("*.patch"))
        return cls(TARGETS[target], version, Path(root), {f.name: parse(f.read_text()) for f in files})

    @classmethod
    def installed(cls, target: str, patch_dir: Path | None = None) -> "PatchSet":
        if target not in TARGETS:
            raise PatchError(f"unknown patch target {target!r}; use one of {sorted(TARGETS)}")
        root, version = TARGETS[target].installed()
        return cls.load(target, root, version, patch_dir)

    # -- the manifest ------------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / self.target.package / MANIFEST

    def manifest(self) -> dict:
        if self.manifest_path.is_file():
            return json.loads(self.manifest_path.read_text())
        return {"target": self.target.name, "version": self.version, "applied": {}}

    def _write_manifest(self, manifest: dict) -> None:
        self.manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    # -- state -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, str]:
        """Per patch, in name order: "applied" (recorded, and every file as recorded), "clean" (applies to the
        files as the patches before it leave them: patches may stack on one file), or "conflict"."""
        applied = self.manifest()["applied"]
        final = {p: h["after"] for n in sorted(applied) for p, h in applied[n].items()}  # last patch wins
        pending: dict[str, str] = {}  # file texts as the clean patches so far would leave them
        states = {}
        for name, file_patches in self.patches.items():
            if name in applied:
                ok = all((self.root / p).is_file() and _sha(self.root / p) == final[p] for p in applied[name])
                states[name] = "applied" if ok else "conflict"
                continue
            texts = dict(pending)
            try:
                for fp in file_patches:
                    texts[fp.path] = apply_text(texts[fp.path] if fp.path in texts else _read(self.root / fp.path), fp)
            except (PatchError, FileNotFoundError):
                states[name] = "conflict"
                continue
            pending = texts
            states[name] = "clean"
        return states

    # -- actions -----------------------------------------------------------------------------------------
    def apply(self) -> list[str]:
        """Apply every patch not yet applied; returns the names applied now. Nothing is written when any
        patch conflicts."""
        states = self.status()
        bad = [n for n, s in states.items() if s == "conflict"]
        if bad:
            raise PatchError(f"{self.target.dist} {self.version} at {self.root}: cannot apply {bad} "
                             "(the files differ from what the patches expect); reinstall the package")
        manifest = self.manifest()
        done = []
        for name in (n for n, s in states.items() if s == "clean"):
            record = {}
            for fp in self.patches[name]:
                path = self.root / fp.path
                record[fp.path] = {"before": _sha(path)}
                _write(path, apply_text(_read(path), fp))
                record[fp.path]["after"] = _sha(path)
            manifest["applied"][name] = record
            done.append(name)
        self._write_manifest(manifest)
        return done

    def revert(self) -> list[str]:
        """Take every applied patch back out (last first) and check the files hash exactly as before."""
        manifest = self.manifest()
        states = self.status()
        bad = [n for n in manifest["applied"] if states.get(n) != "applied"]
        if bad:
            raise PatchError(f"cannot revert {bad}: files changed since they were patched, or the patch files "
                             "changed; reinstall the package")
        reverted = []
        for name in sorted(manifest["applied"], reverse=True):
            for fp in reversed(self.patches[name]):
                path = self.root / fp.path
                _write(path, apply_text(_read(path), fp, reverse=True))
                if _sha(path) != manifest["applied"][name][fp.path]["before"]:
                    raise PatchError(f"{path} does not hash as before {name} was applied")
            del manifest["applied"][name]
            self._write_manifest(manifest)
            reverted.append(name)
        self.manifest_path.unlink(missing_ok=True)
        return reverted
