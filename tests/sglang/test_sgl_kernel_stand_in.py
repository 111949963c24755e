"""The CPU stand-in for `sgl_kernel` (patches/cpu/site): any kernel name imports, calling one raises by name, and
its submodules answer dunder lookups as a module does (absent), which `inspect` and torch.library rely on."""
import importlib
import inspect

import pytest


def test_a_submodule_kernel_imports_and_raises_by_name_when_called():
    sub = importlib.import_module("sgl_kernel.quantization")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.quantization\.gptq_gemm has no CPU"):
        sub.gptq_gemm()


def test_a_submodule_has_no_dunder_attributes_so_inspect_can_walk_it():
    sub = importlib.import_module("sgl_kernel.scalar_type")
    assert not hasattr(sub, "__file__")
    # what torch.library does when an op registers: find a frame's module, which walks every module's file
    frame = inspect.currentframe()
    assert inspect.getmodule(frame, frame.f_code.co_filename).__name__ == __name__
