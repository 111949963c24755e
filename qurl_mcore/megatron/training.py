"""Megatron-Core's own training stack around one GPTModel, the same code on GPUs and (cpu_compat.py) on CPUs:
`DistributedDataParallel` (bucketed gradient reduction into fp32 main grads), `finalize_model_grads`, the
schedules' `get_forward_backward_func`, and `get_megatron_optimizer` (Adam; bf16 parameters with fp32 main
weights when the model is bf16; optionally the distributed optimizer).

The loss is a *sum*: every micro-batch's loss function returns (Σ of its loss units, its number of units)
and Megatron runs with `calculate_per_token_loss`, so the gradient that reaches the optimizer is

    ∇ [ Σ_{data-parallel ranks, micro-batches} loss_sum ] / Σ_{ranks, micro-batches} units

whatever the split into ranks and micro-batches (the units are tokens for a token mean, sequences for a
sequence mean). `step` then clips to `clip_grad` and steps, or skips the update when the gradient norm is not
finite (a NaN reaches every rank through the reductions, so all ranks skip together).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func


@dataclass
class TrainingStack:
    model: torch.nn.Module  # the GPTModel (what checkpoints, exports and log-prob passes see)
    ddp: torch.nn.Module  # Megatron's DistributedDataParallel around it (what the schedules run)
    optimizer: Any  # a MegatronOptimizer

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())


def freeze(model: torch.nn.Module, group: str) -> list[str]:
    """Keep the parameters of the architecture table's group `group` (`qurl_mcore.models.slots.GROUPS`, e.g.
    "experts") as they are: without a gradient, Megatron's DDP gives them no buffer and the optimizer no state.
    Call before `build_training`. Returns the names frozen (none on a pipeline stage without such layers)."""
    from qurl_mcore.models.registry import megatron_slot

    names = []
    for name, param in model.named_parameters():
        slot = megatron_slot(name)
        if slot is not None and slot.group == group:
            param.requires_grad_(False)
            names.append(name)
    return names


def build_training(model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, clip_grad: float = 1.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   distributed_optimizer: bool = False, overlap_grad_reduce: bool = False) -> TrainingStack:
    """Wrap `model` (a GPTModel whose config has `calculate_per_token_loss=True`) in Megatron's DDP and build
    its optimizer. bf16 parameters get fp32 main weights and fp32 gradient reduction."""
    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError("build the model with calculate_per_token_loss=True: the loss functions return sums")
    ddp = DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                                 use_distributed_optimizer=distributed_optimizer))
    if overlap_grad_reduce:  # as Megatron's training loop sets them: only the last micro-batch of a step counts
        # its gradients "ready" (and starts the bucket's reduce), whatever the number of micro-batches
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync  # the pipeline schedules start the reduce per stage
    config.finalize_model_grads_func = finalize_model_grads
    bf16 = config.params_dtype == torch.bfloat16
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
                        adam_eps=eps, clip_grad=clip_grad, bf16=bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=distributed_optimizer),
        [ddp])
    return TrainingStack(model, ddp, optimizer)


def forward_backward(stack: TrainingStack, micro_batches: list, forward: Callable, *, seq_length: int,
                     micro_batch_size: int, forward_only: bool = False) -> list[dict]:
    """Run the schedule over `micro_batches`: `forward(model, micro_batch)` returns (model output, loss_func)
    with loss_func(output) -> (loss_sum, units, metrics dict). Returns the metrics dicts (on the last pipeline
    stage; empty lists elsewhere). Gradients accumulate into the DDP buffers, reduced and divided by the total
    units at the end (finalize_model_grads)."""
    def step_func(data_iterator, model):
        return forward(model, next(data_iterator))

    if not forward_only:
        stack.ddp.zero_grad_buffer()
        stack.optimizer.zero_grad()
    return get_forward_backward_func()(
        forward_step_func=step_func, data_iterator=iter(micro_batches), model=[stack.ddp],
        num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only)


def forward_only(model: torch.nn.Module, micro_batches: list, forward: Callable, *, seq_length: int,
                 micro_batch_size: int) -> list:
    """The schedule without backward over `micro_batches` of any model (no DDP needed): `forward(model,
    micro_batch)` returns (model output, collect) and the result is the list of collect(output) values (on the
    last pipeline stage; an empty list elsewhere)."""
    def step_func(data_iterator, model_chunk):
        output, collect = forward(model_chunk, next(data_iterator))
        return output, lambda out: (torch.zeros((), device=out.device), {"value": collect(out)})

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=True)
    return [record["value"] for record in out]


def step(stack: TrainingStack, clip_grad: float, skip: bool = False) -> tuple[float, bool]:
    """Clip and apply the accumulated gradients. Returns (gradient norm, skipped): the update is skipped when
    the norm (or `skip`, e.g. a non-finite loss) says so, leaving weights and optimizer state untouched."""
    optimizer = stack.optimizer
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    skipped = bool(found_inf) or skip or not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad()
        stack.ddp.zero_grad_buffer()
        return grad_norm, True
    if clip_grad > 0:
        for sub in _optimizers(optimizer):  # dense and expert parameters may have optimizers of their own
            params = sub.get_parameters()
            if params:
                clip_grads.clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm)
    optimizer.step_with_ready_grads()
    return grad_norm, False


def optimizer_state(stack: TrainingStack) -> dict:
    """This rank's optimizer state, for its own checkpoint file: the state dict, and with the distributed
    optimizer also this rank's shard of the main weights and moments (which its state dict leaves out)."""
    subs = list(_optimizers(stack.optimizer))
    return {"state": stack.optimizer.state_dict(),
            "shards": [_unpadded(sub.get_parameter_state_dp_reshardable())
                       if hasattr(sub, "get_parameter_state_dp_reshardable") else None for sub in subs]}


def _unpadded(shard: dict) -> dict:
    """A distributed optimizer's shard with each parameter's entry marked as no padding: megatron-core 0.16.1's
    `load_parameter_state_from_dp_reshardable` reads a `padding` flag that its getter never writes (only its
    dist-checkpoint path inserts padding entries, and flags them), so the pair alone fails with KeyError."""
    for dtypes in (v for k, v in shard.items() if isinstance(k, int)):
        for buckets in dtypes.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return shard


def load_optimizer_state(stack: TrainingStack, state: dict) -> None:
    """Inverse of `optimizer_state`, on a stack of the same parallel layout."""
    stack.optimizer.load_state_dict(state["state"])
    for sub, shard in zip(_optimizers(stack.optimizer), state["shards"]):
        if shard is not None:
            sub.load_parameter_state_from_dp_reshardable(shard)


def _optimizers(optimizer) -> Iterable:
    return getattr(optimizer, "chained_optimizers", [optimizer])
