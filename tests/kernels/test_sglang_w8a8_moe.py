"""SGLang's W8A8 fused-MoE Triton path under Triton's interpreter (tests/kernels/interpreted_w8a8.py), in a
process of its own: the interpreter must be on before triton is imported, and this keeps it, and the shims
that path needs on a CPU, out of every other test."""
from __future__ import annotations

import pytest

from .interpreter import assert_interpreted_passes


@pytest.mark.slow  # importing SGLang in the interpreter's process: about 20 s of CPU
def test_sglang_w8a8_experts_equal_the_emulation_under_the_interpreter():
    assert_interpreted_passes("tests/kernels/interpreted_w8a8.py")
