"""The FP4 Triton kernels under Triton's interpreter (tests/kernels/interpreted_fp4.py), in a process of
their own: the interpreter must be on before triton is imported, and this keeps it out of every other test."""
from __future__ import annotations

from .interpreter import assert_interpreted_passes


def test_fp4_kernels_equal_their_references_under_the_interpreter():
    assert_interpreted_passes("tests/kernels/interpreted_fp4.py")
