"""verl 0.9.1's SGLang rollout on SGLang 0.5.23, patched as verl imports it: the pinned set `patches/verl/0.9.1/`
(its README says what each patch fixes) applied to the modules' source in memory, site-packages untouched.

Importing this module installs an import hook (`sys.meta_path`) that hands Python the patched source of the
modules the set changes, in place of the installed files, and refuses when it comes too late: one of them is
already imported unpatched. verl imports the modules named in `VERL_USE_EXTERNAL_MODULES` at `import verl`
(`verl/__init__.py:49-52`), before any of its rollout modules, in every process that imports verl:

    VERL_USE_EXTERNAL_MODULES=qurl_mcore.integrations.verl_rollout,qurl_mcore.integrations.verl

`actor_rollout_ref.model.external_lib` cannot carry it: verl imports that from `HFModelConfig.__post_init__`
(`verl/workers/config/model.py:149`), which in the rollout server's Ray actor runs, if at all (it may be handed
a built config), in `SGLangHttpServer.__init__`, after Ray imported the class's module, one of the patched ones.

When `qurl patch apply --target verl` patched the files already, the hook has nothing to do and installs
nothing; a set applied in part is refused, as `qurl patch` refuses it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import sys
from pathlib import Path

from qurl_mcore.patching import PatchError, PatchSet
from qurl_mcore.patching.diff import apply_text

HOW_TO_LOAD = "VERL_USE_EXTERNAL_MODULES=qurl_mcore.integrations.verl_rollout in every verl process's environment"


class PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    """Loads `path` as `source` says: the installed file's name (`__file__`, tracebacks), the patched text
    (compiled here, never from or into the file's bytecode cache, which holds the unpatched module; and in
    `linecache`, so that tracebacks and `inspect` show the lines that run, not the file's)."""

    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self.source = source

    def get_source(self, fullname: str) -> str:
        return self.source

    def get_code(self, fullname: str):
        lines = self.source.splitlines(keepends=True)
        linecache.cache[self.path] = (len(self.source), None, lines, self.path)  # mtime None: never reread
        return compile(self.source, self.path, "exec", dont_inherit=True)


class PatchedModules(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` finder for the modules of `sources` (module name -> (installed file, patched text))."""

    def __init__(self, sources: dict[str, tuple[Path, str]]):
        self.sources = sources

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.sources:
            return None
        origin, source = self.sources[fullname]
        return importlib.util.spec_from_file_location(
            fullname, origin, loader=PatchedSourceLoader(fullname, str(origin), source))


def patched_sources(patches: PatchSet) -> dict[str, tuple[Path, str]]:
    """Module name -> (installed file, its text with every patch of `patches` applied, in order); empty when
    the files on disk carry the whole set already."""
    states = patches.status()
    if set(states.values()) == {"applied"}:
        return {}
    if set(states.values()) != {"clean"}:
        raise PatchError(f"{patches.target.dist} {patches.version} at {patches.root}: the patches are applied "
                         f"in part or do not apply ({states}); run `qurl patch revert --target "
                         f"{patches.target.name}` or reinstall it")
    texts: dict[str, str] = {}
    for file_patches in patches.patches.values():
        for fp in file_patches:
            installed = patches.root / fp.path
            texts[fp.path] = apply_text(texts.get(fp.path) or installed.read_bytes().decode(), fp)
    return {path.removesuffix(".py").replace("/", "."): (patches.root / path, text) for path, text in texts.items()}


def install(patches: PatchSet | None = None) -> PatchedModules | None:
    """Put the hook for `patches` (default: the pinned set of the installed verl) first on `sys.meta_path`;
    returns it, or None when there is nothing to patch. Raises ImportError when a module it patches is
    already imported, i.e. the hook comes too late for this process."""
    try:
        sources = patched_sources(patches or PatchSet.installed("verl"))
    except PatchError as err:
        raise ImportError(f"qurl_mcore.integrations.verl_rollout: {err}") from None
    late = sorted(name for name in sources if name in sys.modules)
    if late:
        raise ImportError(f"qurl_mcore.integrations.verl_rollout: {', '.join(late)} imported already, unpatched; "
                          f"load the hook before verl's rollout: {HOW_TO_LOAD}")
    if not sources:
        return None
    hook = PatchedModules(sources)
    sys.meta_path.insert(0, hook)
    return hook


HOOK = install()
