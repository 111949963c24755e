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
from typing import Any

import torch
import torch.distributed as dist

from qurl_mcore.config import Config
from qurl_mcore.models import resolve_model_path
from qurl_mcore.rl.losses import policy_loss

from . import checkpoint as ckpt
from .batch import TrainBatch
from .tracking import redirect_output

def _normaliser(mask: torch.Tensor, agg: str) -> float:
    if agg == "token_mean":
        return float(mask.sum())
    if agg == "seq_mean_token_mean":
        return float((mask.sum(dim=-1) > 0).sum())
    return float(mask.shape[0])


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron marks expert parameters allreduce=False


class PolicyTrainer:
    """One rank of the actor: a Megatron GPTModel (the trainer side of the configured precision, UAQ-scaled
    when on), a frozen reference copy when a KL term is on, AdamW, and the clients of the engines this rank
    pushes weights to."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, log_file: str | None = None):
        if log_file:  # an actor of a run: its output (Megatron's warnings included) goes to the run's logs
            redirect_output(log_file)
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
        self.device = torch.device("cpu")
        precision, scope, fmt = cfg.resolved_precision()
        self.model = build_gpt(self.hf_dir, precision=precision.name, scope=scope, fmt=fmt)
        load_hf_weights(self.model, self.hf_dir)
        if cfg.uaq.enabled:
            # training runs in the rescaled parameterisation, so every update is s times larger relative to
            # the rollout's quantization step (QuRL §4.3); the function computed is unchanged
            apply_uaq(self.model, cfg.uaq.scale)
        self.ref = None
        if t.kl_coef > 0:
            self.ref = build_gpt(self.hf_dir, precision=precision.name, scope=scope, fmt=fmt)
            load_hf_weights(self.ref, self.hf_dir)
            self.ref.requires_grad_(False).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.engine_ids: list[int] = []  # the engines this rank pushes to (connect_engines)
        self.engines: list = []  # their clients
        self.sender = None  # rank 0 of the weight broadcast group (disaggregated layout)

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
        Returns metrics; a non-finite loss or gradient skips the update (`train/skipped_nonfinite` = 1)."""
        start = time.perf_counter()
        full = self._pad_width(batch)
        local = full.select(slice(self.dp_rank, None, self.dp_size))
        ref = self._no_grad_logprobs(self.ref, local) if self.ref is not None else None
        t_ref = time.perf_counter()
        metrics, weight, nonfinite = self._forward_backward(local, ref, _normaliser(full.response_mask, self.cfg.train.agg))
        if nonfinite:  # NaN gradients reach every rank through the reductions below, so all ranks skip
            for p in self.model.parameters():
                p.grad = torch.full_like(p, math.nan)
        self._sync_grads()
        metrics = self._reduce_metrics(metrics, weight)
        grad_norm = self._grad_norm()
        skipped = nonfinite or not math.isfinite(grad_norm) or \
            not all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/"))
        capture = None if skipped else self._capture_before()
        self._update(grad_norm, skipped)
        end = time.perf_counter()
        metrics.update({
            "train/grad_norm": grad_norm, "train/skipped_nonfinite": float(skipped), "train/lr": self.cfg.train.lr,
            "time/ref_logprobs": t_ref - start, "time/train": end - t_ref,
            "perf/train_tokens_per_s": float(full.attention_mask.sum()) / max(end - start, 1e-9),
            "train/response_tokens": float(full.response_mask.sum()),
        })
        if capture is not None:
            metrics["uaq/update_capture"] = self._capture_after(capture)
        return metrics

    def _forward_backward(self, local: TrainBatch, ref: torch.Tensor | None,
                          norm: float) -> tuple[dict[str, float], float, bool]:
        """Gradients of this rank's rows, micro-batch by micro-batch, each loss weighted by its share `w` of
        the global normaliser `norm`. Returns (metrics as w-weighted means, the sum of w, whether an input
        was non-finite: then the backward stops early)."""
        t = self.cfg.train
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        total = 0.0
        for i, mb in enumerate(local.micro_batches(t.micro_batch_size)):
            rows = slice(i * t.micro_batch_size, (i + 1) * t.micro_batch_size)
            out = self._logprobs(self.model, mb, grad=True)
            weight = _normaliser(mb.response_mask, t.agg) / norm
            if weight == 0:
                continue
            ref_mb = None if ref is None else ref[rows]
            inputs = (out.logprobs, mb.behav_logprobs) + (() if ref_mb is None else (ref_mb,))
            if not all(torch.isfinite(x[mb.response_mask]).all() for x in inputs):
                return {}, total, True  # e.g. an engine's -inf behaviour log-prob: skip the step, keep the run
            loss, metrics = policy_loss(
                out.logprobs, out.logprobs.detach(), mb.behav_logprobs, mb.advantages, mb.response_mask,
                method=t.loss, eps_low=t.eps_low, eps_high=t.eps_high, tis_cap=t.tis_cap, agg=t.agg,
                ref_logprobs=ref_mb, kl_coef=t.kl_coef, kl_estimator=t.kl_estimator,
                entropy=out.entropy, entropy_coef=t.entropy_coef)
            (loss * weight).backward()
            total += weight
            for key, value in metrics.items():
                sums[key] = max(sums.get(key, -math.inf), value) if key.endswith("/max") else \
                    sums.get(key, 0.0) + weight * value
        means = {k: (v if k.endswith("/max") else v / total) for k, v in sums.items()} if total else {}
        return means, total, False

    def _update(self, grad_norm: float, skipped: bool) -> None:
        """Clip to `train.grad_clip` and step, or drop the gradients of a skipped step."""
        clip = self.cfg.train.grad_clip
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            return
        if clip > 0 and grad_norm > clip:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(clip / (grad_norm + 1e-6))
        self.optimizer.step()

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
        """The rollout codes' inputs before the update: the weights of the linears the engines quantize."""
        from qurl_mcore.megatron import linear_group, quantized_weights
        from qurl_mcore.precision import quantizes, rollout_spec

        precision, scope, fmt = self.cfg.resolved_precision()
        if precision.rollout is None or not self.cfg.logging.update_capture:
            return None
        in_scope = lambda name: (g := linear_group(name)) is not None and quantizes(scope, g)  # noqa: E731
        return rollout_spec(precision.rollout, fmt), quantized_weights(self.model, in_scope)

    def _capture_after(self, capture) -> float:
        """Share of rollout-quantized weight codes this update changed (this rank's shards)."""
        from qurl_mcore.megatron import quantized_weights
        from qurl_mcore.uaq import update_capture_ratio

        spec, before = capture
        after = quantized_weights(self.model, lambda name: name in before)
        return update_capture_ratio(before, after, spec.fmt, spec.weight_granularity)

    def pid(self) -> int:
        return os.getpid()

    def quantized_linears(self) -> set[str]:
        """HF module names of the linears this rank's model quantizes (the loop checks them)."""
        from qurl_mcore.megatron import quantized_linears

        return quantized_linears(self.model, self.hf)

    # -- weights for the rollout engines ----------------------------------------------------------------------
    def connect_engines(self, endpoints: list[tuple[str, str | None]]) -> None:
        """Attach to the engines this rank pushes to, given every engine's (url, api key) in engine order:
        colocated, rank i pushes to engine i (they share a node: tensors travel by shared memory or CUDA
        IPC); disaggregated, rank 0 pushes to every engine by broadcast. Called again after a restart."""
        from qurl_mcore.rollout import HttpEngine

        from .rollout import engine_config

        if self.cfg.layout == "colocated":
            self.engine_ids = [self.rank] if self.rank < len(endpoints) else []
        else:
            self.engine_ids = list(range(len(endpoints))) if self.rank == 0 else []
        config = engine_config(self.cfg, str(self.hf_dir), self.device.type)
        self.engines = [HttpEngine(config, endpoints[i][0], api_key=endpoints[i][1]) for i in self.engine_ids]

    def open_weight_group(self, group_name: str, backend: str, timeout: float) -> str:
        """Rank 0, disaggregated: a weight group with every engine's TP ranks, hosted on this node (blocks
        until every engine joined). Returns the rendezvous address."""
        import ray

        from qurl_mcore.rollout.broadcast import open_weight_group
        from qurl_mcore.transfer import free_port

        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        self.sender = open_weight_group(self.engines, addr, port, group_name, backend, timeout)
        return f"{addr}:{port}"

    def close_weight_group(self) -> None:
        from qurl_mcore.rollout.broadcast import close_weight_group

        if self.sender is not None:
            close_weight_group(self.sender, self.engines)
            self.sender = None

    def push_weights(self, version: str, only: list[int] | None = None) -> float:
        """Stream this rank's weights to its engines as weight `version` (of `only` those engines, if
        given), one bucket at a time: the HF-named export (UAQ-scaled when UAQ is on: the trainer's
        parameters already are) gathers each bucket just before it goes out. Collective: every rank
        iterates the whole export, also after its own engine failed. Returns the seconds taken; raises
        EngineFailure naming the engine that failed."""
        from qurl_mcore.megatron import export_hf_weights
        from qurl_mcore.rollout.broadcast import broadcast_weights
        from qurl_mcore.rollout.engine import WeightPushError, WeightSpecError

        from .rollout import EngineFailure

        start = time.perf_counter()
        r = self.cfg.rollout
        bucket_bytes = r.push_bucket_mb << 20
        stream = export_hf_weights(self.model, self.hf, bucket_bytes=bucket_bytes, dtype=getattr(torch, r.dtype))
        targets = [k for k, i in enumerate(self.engine_ids) if only is None or i in only]
        failure: Exception | None = None
        try:
            if self.sender is not None:
                broadcast_weights(self.sender, self.engines, stream, version)
            elif targets:
                (k,) = targets
                self.engines[k].push_weights((nt for bucket in stream for nt in bucket), version,
                                             bucket_bytes=bucket_bytes)
        except WeightSpecError:
            raise  # our export disagrees with the checkpoint: no engine restart fixes that
        except Exception as err:  # noqa: BLE001 - a transport or engine error: that engine restarts
            k = err.engine if isinstance(err, WeightPushError) and err.engine is not None else targets[0]
            failure = EngineFailure(self.engine_ids[k], f"weight push: {type(err).__name__}: {err}"[:2000])
        finally:
            for _ in stream:  # the export gathers shards from every rank: finish it with the others
                pass
        if failure is not None:
            raise failure
        return time.perf_counter() - start

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's model shards and optimizer state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "config": asdict(self.cfg.train)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, root: str, step: int) -> dict[str, Any]:
        """Write this rank's state into step `step`'s partial checkpoint (here, not through the driver);
        returns the file's record for `checkpoint.finalize`."""
        return ckpt.write_file(root, step, ckpt.rank_file(self.rank), self.state())

    def load_checkpoint(self, path: str) -> None:
        """Load this rank's state from a published (verified) checkpoint."""
        self.load_state(ckpt.read_file(path, ckpt.rank_file(self.rank)))

    def close(self) -> None:
        from qurl_mcore.megatron import destroy_parallel

        self.close_weight_group()
        destroy_parallel()
