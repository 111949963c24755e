"""Process groups for Megatron-Core: one call to start them (gloo on CPU, NCCL on GPU), one to stop them, and
`spawn` to run a function on N local ranks and collect what each returns (tests, benchmarks, one-node runs)."""
from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core import tensor_parallel as mtp

from qurl_mcore.stack import Stack
from qurl_mcore.transfer import comm_backend, free_port, stores_bound_to_their_address

from . import sync_free
from .cpu_compat import apply_cpu_compat, revert_cpu_compat


def init_parallel(
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    pipeline_parallel: int = 1,
    *,
    seed: int = 1234,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Start torch.distributed (if needed) and Megatron's model-parallel groups, and seed Megatron's RNGs;
    first Megatron's fixes for this device (`cpu_compat`) and its functions that need not read the device
    back (`sync_free`).

    Rank and world size come from the arguments or the usual RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    environment; a lone process without them gets world size 1 on a free local port. `expert_tensor_parallel`
    defaults to 1 when experts are sharded (EP > 1), else to `tensor_parallel`.
    """
    apply_cpu_compat()
    sync_free.install(Stack.installed())
    bind_device()  # before NCCL's communicators, which take the current device
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if "MASTER_PORT" in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            init_method = None
        elif world_size != 1:
            raise RuntimeError("MASTER_PORT is not set; every rank needs the same rendezvous port")
        else:  # the port stays out of the environment: a child process would inherit it while this one holds it
            init_method = f"tcp://127.0.0.1:{free_port()}"
        with stores_bound_to_their_address():
            dist.init_process_group(comm_backend(), init_method=init_method, rank=rank, world_size=world_size)
    if expert_tensor_parallel is None:
        expert_tensor_parallel = 1 if expert_parallel > 1 else tensor_parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    mtp.model_parallel_cuda_manual_seed(seed)


def bind_device() -> torch.device:
    """This process's device: the GPU it owns (LOCAL_RANK under srun/torchrun; the one Ray made visible), set
    as torch's current device so that Megatron, NCCL and every default allocation land on it; else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def current_device() -> torch.device:
    """The device `bind_device` chose."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group, and undo `init_parallel`'s CPU fixes."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    revert_cpu_compat()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    # one node: the local rank is the rank, and bind_device takes GPU LOCAL_RANK
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        # plain pickle copies tensors by value: torch's queue would share their memory with a dying process
        queue.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the duration (processes started inside inherit them), then as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
          cpu: bool = False) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` fresh local processes and return their results in rank order.

    `fn` must be importable (a module-level function) and its results picklable; it typically calls
    `init_parallel(...)` first. A failure in any rank raises RuntimeError carrying that rank's traceback.
    `cpu`: the processes see no GPU (CUDA_VISIBLE_DEVICES empty from their start, before CUDA can
    initialise), so they run on the CPU with gloo however many ranks and GPUs there are.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    with _environment({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}):
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        if not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
        elif any(p.exitcode not in (None, 0) for p in procs):  # died without reporting (a crash, a kill)
            errors.append(f"ranks exited with codes {[p.exitcode for p in procs]}")
        elif time.monotonic() > deadline:
            errors.append(f"no result from every rank within {timeout:.0f} s")
        else:
            time.sleep(0.02)
    for p in procs:  # after a failure the other ranks may block in a collective forever
        p.join(timeout=5 if errors else None)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
