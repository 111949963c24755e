"""CPU stand-in for SGLang's `sgl_kernel` extension (see patches/cpu/README.md): importing any name works,
calling it raises NotImplementedError naming the kernel."""

__version__ = "0.0.0+qurl-cpu-stand-in"


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU implementation; this code path needs a GPU build of sgl-kernel"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
