"""What the tests of tests/gpu_trace run in a traced process (`qurl_mcore.fakecuda.run_traced`): module-level
functions with picklable arguments and results."""
from __future__ import annotations

import torch
import torch.distributed as dist

from qurl_mcore.fakecuda import NcclDeviceError, fake_cuda


def collectives() -> dict:
    """Which tensors the NCCL-like default group and a gloo group take, and what a device mix does."""
    out = {}
    with fake_cuda(devices=8, world_size=8, rank=3, device=3) as trace:
        x = torch.empty(1024, device="cuda")
        dist.all_reduce(x)
        out["device"] = str(x.device)
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.float64))
        except NcclDeviceError as err:
            out["nccl_cpu"] = str(err)
        dist.all_reduce(torch.ones(3), group=dist.new_group([0, 1, 2, 3], backend="gloo"))
        try:
            x[:3] + torch.ones(3)
        except RuntimeError as err:
            out["mix"] = type(err).__name__
        y = x[2:].to(torch.bfloat16).cuda()
        out["live"], out["peak"] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        del x
        out["live_after_del"] = torch.cuda.memory_allocated()
        out["peak_after_del"] = trace.peak_bytes
        out["y"] = (str(y.device), str(y.dtype))
        out["capability"] = torch.cuda.get_device_capability()
    return out


def model_parallel(tp: int, world_size: int, rank: int) -> dict:
    """Megatron's groups on the fake group: this rank's place in them."""
    from megatron.core import parallel_state as ps

    from qurl_mcore.megatron import init_parallel

    with fake_cuda(devices=8, world_size=world_size, rank=rank, device=rank % 8):
        init_parallel(tp, 1, rank=rank, world_size=world_size)
        return dict(tp=ps.get_tensor_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
                    tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def trainer_steps(arch: str, overrides: list[str], rows: list[int], tp: int = 2, world_size: int = 8,
                  rank: int = 1) -> dict:
    """A PolicyTrainer rank (bf16, Megatron's DDP with overlap_grad_reduce, the configured optimizer) built
    from tiny `arch` and stepped once per entry of `rows` (rows of the whole batch; this rank keeps its
    DP share), traced as rank `rank` of `world_size`. Returns the parameters' (device, dtype) kinds of the
    policy and reference, and the peak CUDA bytes after the build and after each step."""
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer
    from qurl_mcore.models.tiny import tiny_checkpoint
    from tests.loop.workers import batch

    path = tiny_checkpoint(arch, tokenizer=False)
    cfg = load_config(None, [f"model.path={path}", "precision=bf16", "uaq.enabled=false", "train.loss=ppo",
                             "train.lr=1e-3", f"train.tp_size={tp}", "train.micro_batch_size=2", *overrides])
    out = {}
    with fake_cuda(devices=8, world_size=world_size, rank=rank, device=rank % 8) as trace:
        trainer = PolicyTrainer(cfg, cfg.recipe(), rank=rank, world_size=world_size)
        out["policy"] = sorted({(str(p.device), str(p.dtype)) for p in trainer.model.parameters()})
        if trainer.ref is not None:
            out["reference"] = sorted({(str(p.device), str(p.dtype)) for p in trainer.ref.parameters()})
        out["peaks"] = [trace.peak_bytes]
        for n in rows:
            trainer.step(batch(rows=n, moe=trainer.moe))
            out["peaks"].append(trace.peak_bytes)
        trainer.close()
    return out


def scaled_mm_out_dtype(gpu: str) -> tuple[str, str]:
    """The out_dtype `quantized_matmul` asks torch._scaled_mm for with fp8 row-wise operands on `gpu`, and the
    dtype it returns (fp32 asked)."""
    from torch.overrides import TorchFunctionMode

    from qurl_mcore.quant.qtensor import quantize
    from qurl_mcore.quant.gemm import quantized_matmul

    asked = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch._scaled_mm:
                asked.append(str(kwargs.get("out_dtype")))
            return func(*args, **(kwargs or {}))

    with fake_cuda(gpu=gpu):
        a = quantize(torch.randn(32, 64, device="cuda"), "fp8_e4m3", "token")
        b = quantize(torch.randn(48, 64, device="cuda"), "fp8_e4m3", "channel")
        with Record():
            out = quantized_matmul(a, b, backend="fp8", out_dtype=torch.float32)
    return asked[0], str(out.dtype)
