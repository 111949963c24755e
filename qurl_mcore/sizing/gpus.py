"""The GPUs `qurl plan` sizes a run for and the links a weight push can cross: each GPU's usable HBM, its
bandwidth, dense tensor-core TFLOP/s per format, NVLink, and SGLang's defaults for its memory class; each link's
GB/s per direction."""
from __future__ import annotations

from dataclasses import dataclass


GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """An accelerator: usable HBM (the spec sheet's decimal GB: the ~7% to the physical GiB covers the CUDA
    context, NCCL buffers and allocator fragmentation), its bandwidth, dense tensor-core TFLOP/s per format,
    NVLink per direction, and SGLang 0.5.23's defaults for its memory class (chunked_prefill_size, the decode
    CUDA-graph batch at engine TP < 4; sglang/srt/arg_groups/memory_hook.py)."""

    name: str
    hbm_gb: float
    hbm_tb_s: float
    tflops: dict[str, float]
    nvlink_gb_s: float
    sglang_chunk: int
    sglang_decode_bs: int

    @property
    def hbm(self) -> int:
        return int(self.hbm_gb * GB)

    def has_tensor_cores(self, fmt: str | None) -> bool:
        """Whether GEMMs in `fmt` (None: bf16) run on tensor cores of their own; without, its numerics are
        emulated (dequantized to bf16 and multiplied there)."""
        return (fmt or "bf16") in self.tflops

    def peak_tflops(self, fmt: str | None) -> float:
        """Dense tensor-core peak for GEMMs in `fmt` (None: bf16); a format without tensor cores runs at bf16's."""
        return self.tflops.get(fmt or "bf16", self.tflops["bf16"])


_HOPPER = {"bf16": 989.0, "int8": 1979.0, "fp8_e4m3": 1979.0}  # no FP4 tensor cores
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80g", 80, 3.35, _HOPPER, 450, 8192, 256),
    GPU("h200-141g", 141, 4.8, _HOPPER, 450, 8192, 256),
    GPU("b200-180g", 180, 8.0, {"bf16": 2250.0, "int8": 4500.0, "fp8_e4m3": 4500.0, "nvfp4": 9000.0,
                                "mxfp4": 9000.0}, 900, 16384, 512),
)}

#: seconds of one small all-reduce among an engine's TP GPUs over NVLink: an assumption (docs/plan.md), the
#: latency that bounds a decode step whatever its bytes
NVLINK_ALLREDUCE_S = 10e-6

#: links a weight push can cross, GB/s per direction ("nvlink" is the GPU's own, `GPU.nvlink_gb_s`)
LINKS: dict[str, float] = {
    "infiniband": 50.0,  # NDR, 400 Gb/s per GPU NIC
    "pcie": 64.0,  # Gen5 x16
}
LINK_NAMES = ("nvlink", *LINKS)


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; use one of {list(GPUS)}") from None


def local_gpu() -> str | None:
    """The `GPUS` key of this machine's first CUDA device, by its name (None: no GPU, or one not in the
    table)."""
    import torch  # seconds to import: `qurl plan` and `qurl --help` never call this

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).lower()
    return next((key for key in GPUS if key.split("-")[0] in name), None)


def link_gb_s(link: str, gpu: GPU) -> float:
    if link == "nvlink":
        return gpu.nvlink_gb_s
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; use one of {list(LINK_NAMES)}")
    return LINKS[link]
