"""Unified diffs applied exactly, forward or reverse: every hunk must match the file byte for byte at the
line its header names (no fuzz, no offset search).

A pinned patch set targets one version of one package; a silent fuzzy application is how a patched
dependency drifts away from what was reviewed, so a mismatch is an error instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch does not parse, or does not match the file it targets."""


@dataclass
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: list[str] = field(default_factory=list)  # " ", "-" or "+" prefix, then the line with its ending

    def read_write(self, reverse: bool) -> tuple[int, list[str], list[str]]:
        """(0-based index of the first line to replace, lines expected there, lines to put there)."""
        old = [ln[1:] for ln in self.lines if ln[0] in " -"]
        new = [ln[1:] for ln in self.lines if ln[0] in " +"]
        start, count = (self.new_start, self.new_count) if reverse else (self.old_start, self.old_count)
        # a header "-l,0" means "after line l": the 0-based index l; otherwise line l is index l - 1
        index = start if count == 0 else start - 1
        return (index, new, old) if reverse else (index, old, new)


@dataclass
class FilePatch:
    path: str  # relative to the patch root, with git's "a/" and "b/" prefixes removed
    hunks: list[Hunk]


def _path(header: str) -> str:
    path = header.split("\t")[0].strip()
    if path == "/dev/null":
        raise PatchError("patch sets may only modify existing files (found /dev/null)")
    return path[2:] if path[:2] in ("a/", "b/") else path


def _drop_final_newline(hunk: Hunk) -> None:
    """"\\ No newline at end of file" refers to the line before it."""
    hunk.lines[-1] = hunk.lines[-1][:-1] if hunk.lines[-1].endswith("\n") else hunk.lines[-1]


def parse(text: str) -> list[FilePatch]:
    """The file patches of a unified diff (`git diff` or `diff -u` output)."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            _path(line[4:])
            files.append(FilePatch(_path(lines[i + 1][4:]), []))
            i += 2
        elif (m := _HUNK.match(line)) is not None:
            if not files:
                raise PatchError("hunk before any file header")
            hunk = Hunk(int(m[1]), int(m[2] or 1), int(m[3]), int(m[4] or 1))
            old_left, new_left = hunk.old_count, hunk.new_count
            i += 1
            while old_left > 0 or new_left > 0:
                if i >= len(lines):
                    raise PatchError(f"truncated hunk in {files[-1].path}")
                body = lines[i] if lines[i] != "\n" else " \n"  # some editors strip a blank context line's space
                if body.startswith("\\"):
                    _drop_final_newline(hunk)
                elif body[0] in " -+":
                    old_left -= body[0] in " -"
                    new_left -= body[0] in " +"
                    hunk.lines.append(body)
                else:
                    raise PatchError(f"bad hunk line in {files[-1].path}: {body!r}")
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                _drop_final_newline(hunk)
                i += 1
            files[-1].hunks.append(hunk)
        else:
            i += 1
    if not files:
        raise PatchError("no file patches found")
    return files


def apply_text(text: str, patch: FilePatch, reverse: bool = False) -> str:
    """`text` with the patch's hunks applied (or, with `reverse`, taken back out)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # first line of `lines` not yet copied to `out`; hunks come in file order
    for hunk in patch.hunks:
        start, expect, replace = hunk.read_write(reverse)
        if start < pos or lines[start:start + len(expect)] != expect:
            side = "patched" if reverse else "unpatched"
            raise PatchError(f"{patch.path}: the hunk at line {start + 1} does not match the {side} file")
        out += lines[pos:start] + replace
        pos = start + len(expect)
    return "".join(out + lines[pos:])
