"""The FP4 Triton kernels under Triton's interpreter (tests/kernels/interpreted_fp4.py), in a process of
their own: the interpreter must be on before triton is imported, and this keeps it out of every other test."""
from __future__ import annotations

from .interpreter import run_interpreted


def test_fp4_kernels_equal_their_references_under_the_interpreter():
    done = run_interpreted("tests/kernels/interpreted_fp4.py")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, done.stdout[-6000:] + done.stderr[-3000:]
