"""CPU stand-in for SGLang's `sgl_kernel` extension (see patches/cpu/README.md): importing any name, or any
submodule (`sgl_kernel.quantization`, which SGLang imports on its CUDA branches), works; calling a name (or an attribute of one) raises
NotImplementedError naming the kernel."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+qurl-cpu-stand-in"


class _Unavailable:
    """A kernel (or a table of them, `scalar_types.uint4b8`) that SGLang names at import: calling it raises."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} has no CPU implementation; this code path needs a GPU build of sgl-kernel"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `sgl_kernel.<sub>` is a stand-in module like this one."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _Unavailable(f"{spec.name.partition('.')[2]}.{name}")
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_Submodules())
