"""Make PyPI's CUDA-built torchvision importable on CPU torch (see patches/cpu/README.md).

Loaded by a .pth file in every interpreter of the CPU venv, SGLang's subprocesses included. It only
installs an import hook; the op schemas are defined when torchvision is first imported."""
import importlib.abc
import sys


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            try:
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # already defined by a working torchvision build
                pass
        _keep_alive.append(lib)
        return None  # the regular finders import torchvision itself


_keep_alive: list = []
if not any(isinstance(f, _DefineTorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionOps())
