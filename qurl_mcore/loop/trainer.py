"""The training side of one RL step, on one Megatron rank: π_prox and π_ref log-probs, the policy loss, the
optimizer step, and the weights the rollout engines load next.

Every rank of the trainer group receives the whole batch. Data-parallel rank d takes rows d::dp (after the
driver's shuffle-free collate, so DP shards have similar lengths); tensor/expert-parallel ranks of one DP rank
see the same rows. Each micro-batch loss is its `agg` reduction times its share of the global normaliser (its
response tokens / all response tokens for token_mean, its non-empty sequences / all for the seq_mean_*
aggregations), so summing gradients over DP ranks and micro-batches gives the gradient of the loss of the
whole batch, whatever the split.

Gradients are synchronised as Megatron's DDP would, without its CUDA buffers (so the same code runs on CPU):
  sequence-parallel replicas (norms, routers)  summed over the TP group (each rank saw a sequence shard)
  dense parameters                              summed over the DP group
  expert parameters                             summed over the expert-DP group (tokens from every DP rank
                                                already reached them through the all-to-all)
The gradient norm counts each distinct parameter shard once: TP-duplicated parameters on TP rank 0 only,
reduced over the model-parallel group (dense) or the expert-model-parallel group (experts).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from qurl_mcore.config import Config
from qurl_mcore.rl.losses import policy_loss
from qurl_mcore.rl.metrics import masked_mean

from .batch import TrainBatch

#: rollout precision -> (format, granularity) whose codes the update-capture metric compares
CAPTURE_FORMATS = {"int8": ("int8", "channel"), "fp8": ("fp8_e4m3", "channel")}


def resolve_model_path(path: str) -> Path:
    """`model.path` as an HF checkpoint directory; "smollm2" is the packaged SmolLM2-135M-Instruct and
    "tiny-<arch>" a tiny random model (tests)."""
    if path == "smollm2":
        from qurl_mcore.models.smollm2 import hf_checkpoint

        return hf_checkpoint()
    if path.startswith("tiny-"):
        from qurl_mcore.models.tiny import tiny_checkpoint

        return tiny_checkpoint(path.removeprefix("tiny-"))
    out = Path(path)
    if not (out / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path}: no config.json there; give an HF checkpoint directory, "
                                "'smollm2', or 'tiny-<llama|qwen2|qwen3|qwen3_moe>'")
    return out


def _normaliser(mask: torch.Tensor, agg: str) -> float:
    if agg == "token_mean":
        return float(mask.sum())
    if agg == "seq_mean_token_mean":
        return float((mask.sum(dim=-1) > 0).sum())
    return float(mask.shape[0])


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron marks expert parameters allreduce=False


class PolicyTrainer:
    """One rank of the actor: a Megatron GPTModel (the configured precision recipe, UAQ-scaled when on), a
    frozen reference copy when a KL term is on, and AdamW."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None):
        from qurl_mcore.megatron import apply_uaq, build_gpt, init_parallel, load_hf_weights
        from qurl_mcore.megatron.models import load_hf_config

        self.cfg = cfg
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        if master_port is not None:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        init_parallel(t.tp_size, t.ep_size, seed=cfg.seed, rank=rank, world_size=world_size)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.rank = rank
        self.hf_dir = resolve_model_path(cfg.model.path)
        self.hf = load_hf_config(self.hf_dir)
        fmt = cfg.rollout.fp4_format if t.recipe.startswith("fp4") else None
        self.model = build_gpt(self.hf_dir, recipe=t.recipe, scope=cfg.rollout.scope, fmt=fmt)
        load_hf_weights(self.model, self.hf_dir)
        if cfg.uaq.enabled:
            # training runs in the rescaled parameterisation, so every update is s times larger relative to
            # the rollout's quantization step (QuRL §4.3); the function computed is unchanged
            apply_uaq(self.model, cfg.uaq.scale)
        self.ref = None
        if t.kl_coef > 0:
            self.ref = build_gpt(self.hf_dir, recipe=t.recipe, scope=cfg.rollout.scope, fmt=fmt)
            load_hf_weights(self.ref, self.hf_dir)
            self.ref.requires_grad_(False).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.sender = None  # rank 0 of the weight broadcast group (disaggregated layout)
        self.staged: list | None = None  # buckets awaiting send_weights

    # -- log-probs ------------------------------------------------------------------------------------------
    def _pad_width(self, batch: TrainBatch) -> TrainBatch:
        """Sequence parallelism splits the sequence over TP ranks: pad the width to a multiple of TP."""
        tp = self.cfg.train.tp_size
        extra = -batch.input_ids.shape[1] % tp
        if not extra:
            return batch
        pad = lambda x, v: torch.nn.functional.pad(x, (0, extra), value=v)  # noqa: E731
        return TrainBatch(pad(batch.input_ids, 0), pad(batch.attention_mask, False), pad(batch.response_mask, False),
                          pad(batch.behav_logprobs, 0.0), batch.advantages)

    def _logprobs(self, model, batch: TrainBatch, grad: bool):
        from qurl_mcore.megatron import token_logprobs

        return token_logprobs(model, batch.input_ids, attention_mask=batch.attention_mask,
                              temperature=self.cfg.rollout.temperature, grad=grad,
                              return_entropy=self.cfg.train.entropy_coef > 0 and grad)

    def _no_grad_logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        parts = [self._logprobs(model, mb, grad=False).logprobs for mb in batch.micro_batches(self.cfg.train.micro_batch_size)]
        return torch.cat(parts)

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the policy loss. π_prox is the policy before this step's update: the batch
        takes a single optimizer step, so π_prox equals the training forward's own log-probs (detached) and
        costs no extra pass; π_ref (KL term on) is a no-grad pass of the frozen reference.
        Returns metrics; a non-finite loss or gradient skips the update (`train/skipped` = 1)."""
        t = self.cfg.train
        start = time.perf_counter()
        full = self._pad_width(batch)
        norm = _normaliser(full.response_mask, t.agg)
        local = full.select(slice(self.dp_rank, None, self.dp_size))
        ref = self._no_grad_logprobs(self.ref, local) if self.ref is not None else None
        t_ref = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        weights = 0.0
        nonfinite = False
        size = t.micro_batch_size
        for i, mb in enumerate(local.micro_batches(size)):
            rows = slice(i * size, (i + 1) * size)
            out = self._logprobs(self.model, mb, grad=True)
            weight = _normaliser(mb.response_mask, t.agg) / norm
            if weight == 0:
                continue
            prox = out.logprobs.detach()
            inputs = (out.logprobs, mb.behav_logprobs) + (() if ref is None else (ref[rows],))
            if not all(torch.isfinite(x[mb.response_mask]).all() for x in inputs):
                nonfinite = True  # e.g. an engine's -inf behaviour log-prob: skip the step, keep the run
                break
            loss, metrics = policy_loss(
                out.logprobs, prox, mb.behav_logprobs, mb.advantages, mb.response_mask, method=t.loss,
                eps_low=t.eps_low, eps_high=t.eps_high, tis_cap=t.tis_cap, agg=t.agg,
                ref_logprobs=None if ref is None else ref[rows], kl_coef=t.kl_coef, kl_estimator=t.kl_estimator,
                entropy=out.entropy, entropy_coef=t.entropy_coef)
            (loss * weight).backward()
            weights += weight
            for key, value in metrics.items():
                sums[key] = max(sums.get(key, -math.inf), value) if key.endswith("/max") else \
                    sums.get(key, 0.0) + weight * value
        if nonfinite:  # NaN gradients reach every rank through the reductions below, so all ranks skip
            for p in self.model.parameters():
                p.grad = torch.full_like(p, math.nan)
        self._sync_grads()
        metrics = {k: (v if k.endswith("/max") else v / weights) for k, v in sums.items()} if weights else {}
        metrics = self._reduce_metrics(metrics, weights)
        grad_norm = self._grad_norm()
        loss_finite = all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/"))
        skipped = nonfinite or not (math.isfinite(grad_norm) and loss_finite)
        capture = self._capture_before() if not skipped else None
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if t.grad_clip > 0 and grad_norm > t.grad_clip:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(t.grad_clip / (grad_norm + 1e-6))
            self.optimizer.step()
        end = time.perf_counter()
        tokens = float(full.attention_mask.sum())
        metrics.update({
            "train/grad_norm": grad_norm, "train/skipped": float(skipped), "train/lr": t.lr,
            "time/ref_logprobs": t_ref - start, "time/train": end - t_ref,
            "perf/train_tokens_per_s": tokens / max(end - start, 1e-9),
            "train/response_tokens": float(full.response_mask.sum()),
        })
        if capture is not None:
            metrics["uaq/update_capture"] = self._capture_after(capture)
        return metrics

    def _reduce_metrics(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Weighted means over DP ranks (each rank's weight is its share of the normaliser)."""
        if self.dp_size == 1:
            return metrics
        keys = sorted(metrics)
        sums = torch.tensor([metrics[k] * weight for k in keys] + [weight], dtype=torch.float64)
        dist.all_reduce(sums, group=self.ps.get_data_parallel_group())
        total = float(sums[-1]) or 1.0
        return {k: float(v) / total for k, v in zip(keys, sums[:-1])}

    def _sync_grads(self) -> None:
        ps = self.ps
        for p in self.model.parameters():
            if p.grad is None:  # unused on this rank (e.g. an expert no local token chose)
                if dist.get_world_size() == 1:
                    continue
                p.grad = torch.zeros_like(p)  # the reductions below need every rank to take part
            if getattr(p, "sequence_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            if _is_expert(p):
                if ps.get_expert_data_parallel_world_size() > 1:
                    dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            elif self.dp_size > 1:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())

    def _grad_norm(self) -> float:
        ps = self.ps
        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        tp_rank = ps.get_tensor_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sharded = getattr(p, "tensor_model_parallel", False)
            sq = p.grad.double().pow(2).sum()
            if _is_expert(p):
                if sharded or etp_rank == 0:
                    expert += sq
            elif sharded or tp_rank == 0:
                dense += sq
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
        if ps.get_expert_model_parallel_world_size() * ps.get_expert_tensor_parallel_world_size() > 1:
            dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
        return math.sqrt(float(dense + expert))

    # -- update capture (QuRL §4.3) ---------------------------------------------------------------------------
    def _capture_before(self):
        from qurl_mcore.megatron import quantized_weights

        fmt = CAPTURE_FORMATS.get(self.cfg.rollout.precision)
        return (fmt, quantized_weights(self.model)) if fmt and self.cfg.logging.update_capture else None

    def _capture_after(self, capture) -> float:
        """Share of rollout-quantized weight codes this update changed (this rank's shards)."""
        from qurl_mcore.megatron import quantized_weights
        from qurl_mcore.uaq import update_capture_ratio

        (fmt, granularity), before = capture
        return update_capture_ratio(before, quantized_weights(self.model), fmt, granularity)

    # -- weights for the rollout engines ----------------------------------------------------------------------
    def export(self, bucket_bytes: int, dtype: str = "bfloat16") -> list | None:
        """HF-named tensors in buckets, as the engines load them (UAQ-scaled when UAQ is on: the trainer's
        parameters already are). Collective: every rank calls it; rank 0 gets the buckets, the others None."""
        from qurl_mcore.megatron import export_hf_weights

        out = list(export_hf_weights(self.model, self.hf, bucket_bytes=bucket_bytes, dtype=getattr(torch, dtype)))
        return out if self.rank == 0 else None

    # broadcast pushes (disaggregated layout): rank 0 is rank 0 of a weight group with every engine's TP ranks
    def rendezvous(self) -> tuple[str, int]:
        """An address of this rank's node and a free port there, for the weight group's TCP rendezvous."""
        import ray

        from qurl_mcore.megatron.parallel import free_port

        return ray.util.get_node_ip_address(), free_port()

    def open_weight_group(self, master_addr: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout: float) -> None:
        """Rank 0 only: create the group as its rank 0 (blocks until every engine has joined)."""
        from qurl_mcore.rollout.broadcast import WeightSender

        self.sender = WeightSender.connect(world_size, master_addr, master_port, group_name, backend, timeout)

    def stage_weights(self, bucket_bytes: int) -> list | None:
        """Collective export (as `export`); rank 0 keeps the buckets for `send_weights` and returns their
        specs, which the engines validate and receive by."""
        from qurl_mcore.rollout.broadcast import WeightSender

        self.staged = self.export(bucket_bytes)
        return None if self.staged is None else WeightSender.specs(self.staged)

    def send_weights(self) -> int:
        """Rank 0: broadcast the staged buckets (the engines receive at the same time); returns their number."""
        staged, self.staged = self.staged, None
        return self.sender.send(staged)

    def close_weight_group(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's model shards and optimizer state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "config": asdict(self.cfg.train)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        from qurl_mcore.megatron import destroy_parallel

        self.close_weight_group()
        destroy_parallel()
