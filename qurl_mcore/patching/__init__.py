"""Pinned source patch sets for installed packages (`qurl patch`); see tool.py and docs/patches.md."""
from .diff import PatchError
from .tool import TARGETS, PatchSet

__all__ = ["PatchError", "PatchSet", "TARGETS"]
