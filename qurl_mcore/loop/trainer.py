"""The training side of one RL step, on one Megatron rank: π_prox and π_ref log-probs, the policy loss, the
optimizer steps, and the weights the rollout engines load next.

Every rank of the trainer group receives the whole batch. Data-parallel rank d takes rows d::dp (after the
driver's shuffle-free collate, so DP shards have similar lengths); tensor/expert-parallel ranks of one DP rank
see the same rows. The rows are split into `train.mini_batches` parts, one optimizer step each, and each part
into micro-batches of `train.micro_batch_size` rows for Megatron's schedule (megatron/training.py). Each
micro-batch's loss function returns its `agg` loss times its units (response tokens for token_mean, non-empty
sequences for seq_mean_token_mean, sequences for seq_mean_token_sum) and the units; Megatron divides the
summed gradient by all units of the mini-batch over every DP rank, so the update is that of the loss of the
whole mini-batch, whatever the split into ranks and micro-batches.

π_prox is the policy before the first update of the batch: with one mini-batch it is the training forward's
own log-probs (detached), with more a no-grad pass before the first update (decoupled PPO).

MoE routing (megatron/replay.py): the trainer's own top-k experts are compared with the engine's for every token
that scores a response token, before any replay and with the pre-update weights (`mismatch/topk_match`,
`mismatch/topk_overlap`, and per layer). With `train.routing_replay: r3` every forward of the policy (π_prox
pass, training forward) routes by the engine's experts instead, and the comparison takes one extra no-grad pass
without replay; the frozen reference model (KL term) always routes by itself.

Everything runs on the rank's device: its GPU (the one Ray assigns, or LOCAL_RANK under srun/torchrun), or the
CPU, with the same code (megatron/cpu_compat.py makes Megatron's training stack run on the CPU).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qurl_mcore import checkpoint as ckpt
from qurl_mcore.config import Config
from qurl_mcore.layerwise import LayerwiseModel
from qurl_mcore.models import resolve_model_path
from qurl_mcore.models.registry import num_experts
from qurl_mcore.recipe import Recipe, check_runnable
from qurl_mcore.rl.losses import aggregation_units, policy_loss
from qurl_mcore.rollout import HttpEngine, WeightPushError, WeightSpecError
from qurl_mcore.rollout.broadcast import broadcast_weights, close_weight_group, open_weight_group
from qurl_mcore.rollout.codes import CodePush, engine_units
from qurl_mcore.sglang.options import REQUANTS
from qurl_mcore.smoothing import calibrate, fold_table, smooth_buckets
from qurl_mcore.tasks import chat_ids
from qurl_mcore.transfer import bind_gloo_towards, bind_stores_to_their_address, free_port
from qurl_mcore.uaq import update_capture_ratio

from .batch import TrainBatch
from .sampler import EngineFailure, engine_config, load_prompt_set, prompt_indices, reference_engine_config
from .tracking import redirect_output

# Megatron-Core (and qurl_mcore.megatron, which imports it) is imported in the methods that use it: the driver
# imports this module to create the actors and never loads Megatron, and in an actor Megatron's import-time
# warnings go to the rank's log, which __init__ opens first.


#: Transformer Engine's FP8 GEMMs take a linear's input rows (the tokens on a rank) in multiples of 16: the
#: forward checks 8 (TE `assert_dim_for_fp8_exec`: the product of the leading dims); the weight-gradient GEMM
#: contracts over the tokens, and an FP8 TN GEMM needs its inner dimension a multiple of 16
#: (`check_dim_for_fp8_exec`, Megatron's `get_fp8_align_size` for per-tensor scaling).
TE_FP8_TOKEN_MULTIPLE = 16


def width_multiple(tp_size: int, te_fp8: bool) -> int:
    """The multiple a training batch's width (tokens per row) is padded to: `tp_size`, since sequence
    parallelism gives each TP rank width/TP tokens of a row; times `TE_FP8_TOKEN_MULTIPLE` when Transformer
    Engine runs FP8 GEMMs (`Recipe.te`), so each rank's width/TP · rows tokens is a multiple of it whatever the
    micro-batch's number of rows."""
    return tp_size * (TE_FP8_TOKEN_MULTIPLE if te_fp8 else 1)


class PolicyTrainer:
    """One rank of the actor: a Megatron GPTModel on the rank's device (the trainer side of `recipe`, the run's
    resolved precision: `Config.recipe`, UAQ-scaled when on) inside Megatron's DDP and optimizer (megatron/training.py), a frozen
    reference copy when a KL term is on, and the clients of the engines this rank pushes weights to."""

    #: rollout.smoothing's frozen scales (qurl_mcore/smoothing.py): calibrated at the first push, or restored
    smoothing_scales: dict[str, torch.Tensor] | None = None

    def __init__(self, cfg: Config, recipe: Recipe, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, log_file: str | None = None):
        if log_file:  # an actor of a run: its output (Megatron's warnings included) goes to the run's logs
            redirect_output(log_file)
        from qurl_mcore.megatron import apply_uaq, build_gpt, init_parallel, load_hf_weights
        from qurl_mcore.megatron.dist_checkpoint import BackgroundSave, load_model
        from qurl_mcore.megatron.gpt import load_hf_config
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.parallel import current_device
        from qurl_mcore.megatron.training import build_training, freeze

        self.cfg = cfg
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        if master_port is not None:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.master_addr = master_addr  # rank 0's endpoints listen there: its rendezvous, the weight group
        bind_gloo_towards(master_addr)  # rank 0's node: the trainer's groups and the engines' broadcast group
        bind_stores_to_their_address()  # the rendezvous of the weight group rank 0 hosts, too
        init_parallel(t.tp_size, t.ep_size, pipeline_parallel=t.pp_size, seed=cfg.seed, rank=rank,
                      world_size=world_size)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.rank = rank
        self.device = current_device()
        self.hf_dir = resolve_model_path(cfg.model.path)
        self.hf = load_hf_config(self.hf_dir)
        check_runnable(recipe)
        self.recipe = recipe  # the driver's (start_actors), the same for every rank and, in part, every engine
        build = dict(recipe=self.recipe, dtype=cfg.train_dtype(), recompute=t.recompute,
                     calculate_per_token_loss=True)
        # the starting weights: a Megatron-LM / slime torch_dist checkpoint's (model.load, every tensor), else HF's
        start = (lambda m: load_model(m, cfg.model.load)) if cfg.model.load else (
            lambda m: load_hf_weights(m, self.hf_dir))
        self.model = build_gpt(self.hf_dir, **build)
        start(self.model)
        _refuse_non_finite(self.model, cfg.model.load or str(self.hf_dir))
        if cfg.uaq.enabled:
            # training runs in the rescaled parameterisation, so every update is s times larger relative to
            # the rollout's quantization step (QuRL §4.3); the function computed is unchanged
            apply_uaq(self.model, cfg.uaq.scale, cfg.uaq_scope())
        from qurl_mcore.megatron.replay import RoutingTaps
        self.moe = num_experts(self.hf) > 0
        self.taps = RoutingTaps(self.model)  # none in a dense model (or a pipeline stage without MoE layers)
        self.agreement: torch.Tensor | None = None  # routing agreement sums of this step (replay.py)
        self.measuring = False  # the current pass over the batch measures them (the first without replay)
        if t.frozen != "none":
            freeze(self.model, t.frozen)
        self.stack = build_training(self.model, lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.grad_clip,
                                    distributed_optimizer=cfg.distributed_optimizer(),
                                    overlap_grad_reduce=self.device.type == "cuda")
        self.background_save = BackgroundSave()  # checkpoint.async_save's writes in flight
        self.ref = None
        if t.kl_coef > 0:
            self.ref = build_gpt(self.hf_dir, **build)
            start(self.ref)
            self.ref.requires_grad_(False).eval()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.engine_ids: list[int] = []  # the engines this rank pushes to (connect_engines)
        self.engines: list = []  # their clients
        self.sender = None  # rank 0 of the weight broadcast group (disaggregated layout)
        self._units: dict[str, tuple[str, ...]] | None = None  # the engines' quantized units (rollout/codes.py)

    # -- log-probs ------------------------------------------------------------------------------------------
    def _pad_width(self, batch: TrainBatch) -> TrainBatch:
        """Pad the width to `width_multiple` (sequence parallelism, FP8 on Transformer Engine); the padding is
        masked out of attention keys and of the loss, so the update is that of the unpadded batch."""
        extra = -batch.input_ids.shape[1] % width_multiple(self.cfg.train.tp_size, self.recipe.te)
        if not extra:
            return batch
        pad = lambda x, v: torch.nn.functional.pad(x, (0, extra), value=v)  # noqa: E731
        routed = batch.routed_experts
        if routed is not None:  # [B, S, layers, k]: pad S
            routed = torch.nn.functional.pad(routed.movedim(1, -1), (0, extra), value=-1).movedim(-1, 1)
        return TrainBatch(pad(batch.input_ids, 0), pad(batch.attention_mask, False), pad(batch.response_mask, False),
                          pad(batch.behav_logprobs, 0.0), batch.advantages, routed)

    def _route(self, mb: TrainBatch, replay: bool) -> bool:
        """Before a forward of the policy on `mb`: replay the engine's routing (r3) or route by itself. Returns
        whether to measure the routing agreement after this forward (class docstring)."""
        if not self.taps or mb.routed_experts is None:
            return False
        self.taps.replay(mb.routed_experts if replay else None)
        return not replay and self.measuring

    def _measure(self, mb: TrainBatch) -> None:
        """Add this forward's routing agreement on the tokens that score a response token (position t scores
        token t + 1)."""
        scores = torch.nn.functional.pad(mb.response_mask[:, 1:], (0, 1), value=False)
        self.agreement += self.taps.agreement(mb.routed_experts, scores, self.hf.num_hidden_layers)

    def _micro_batches(self, part: TrainBatch, *extra: torch.Tensor | None) -> list[tuple]:
        """(micro-batch, its rows of each tensor in `extra` or None), on this rank's device."""
        size = self.cfg.train.micro_batch_size
        return [(part.select(rows).to(self.device), *(None if x is None else x[rows] for x in extra))
                for rows in (slice(i, i + size) for i in range(0, len(part), size))]

    def _forward_only(self, model, part: TrainBatch, replay: bool = False) -> torch.Tensor:
        """Log-probs of `part` under `model`, no gradient, through the same schedule (pipeline stages); the
        policy's routing replayed or measured (`_route`)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.logprobs import logprobs_from_logits, model_inputs
        from qurl_mcore.megatron.training import forward_only

        def forward(model_chunk, micro):
            (mb,) = micro
            inputs = model_inputs(mb.input_ids, attention_mask=mb.attention_mask)
            measure = model is self.model and self._route(mb, replay)
            logits = model_chunk(inputs.input_ids, inputs.position_ids, inputs.attention_mask)
            if measure:
                self._measure(mb)

            def collect(out):
                lp, _, _ = logprobs_from_logits(model, out, inputs, temperature=self.cfg.rollout.temperature)
                return lp.detach()

            return logits, collect

        parts = forward_only(model, self._micro_batches(part), forward, seq_length=part.input_ids.shape[1],
                             micro_batch_size=self.cfg.train.micro_batch_size)
        return torch.cat(parts) if parts else torch.empty(0)

    def _loss_forward(self, model_chunk, micro):
        """One micro-batch of the training forward: the logits, and the loss function the schedule calls on
        them, which returns (loss × units, units, metrics)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.logprobs import logprobs_from_logits, model_inputs

        t = self.cfg.train
        mb, prox, ref = micro
        inputs = model_inputs(mb.input_ids, attention_mask=mb.attention_mask)
        measure = self._route(mb, replay=t.routing_replay == "r3")
        logits = model_chunk(inputs.input_ids, inputs.position_ids, inputs.attention_mask)
        if measure:
            self._measure(mb)

        def loss_func(out):
            lp, _, entropy = logprobs_from_logits(self.model, out, inputs, temperature=self.cfg.rollout.temperature,
                                                  return_entropy=t.entropy_coef > 0)
            proximal = lp.detach() if prox is None else prox.to(lp.device)
            reference = None if ref is None else ref.to(lp.device)
            # everything stays on the device: the step reads the metrics back once (_reduce_metrics)
            units = aggregation_units(mb.response_mask, t.agg)
            nonfinite = torch.stack([(mb.response_mask & ~torch.isfinite(x)).any() for x in
                                     (lp, mb.behav_logprobs) + (() if reference is None else (reference,))]).any()
            loss, metrics = policy_loss(
                lp, proximal, mb.behav_logprobs, mb.advantages, mb.response_mask, method=t.loss, eps_low=t.eps_low,
                eps_high=t.eps_high, tis_cap=t.tis_cap, agg=t.agg, ref_logprobs=reference, kl_coef=t.kl_coef,
                kl_estimator=t.kl_estimator, entropy=entropy, entropy_coef=t.entropy_coef, on_device=True)
            # e.g. an engine's -inf behaviour log-prob: NaN gradients reach every rank through the reductions, so
            # every rank skips this update; a micro-batch without response tokens (a DP rank short of rows)
            # adds nothing
            loss = torch.where(units > 0, loss, 0) * torch.where(nonfinite, math.nan, 1.0)
            return loss * units, units, {**metrics, "units": units, "nonfinite": nonfinite}

        return logits, loss_func

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """`train.mini_batches` optimizer steps on the policy loss (module docstring). π_ref (KL term on) is a
        no-grad pass of the frozen reference. Returns metrics; an update whose loss or gradient is not finite
        is skipped (`train/skipped_nonfinite`: the fraction of this batch's updates skipped)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.training import forward_backward
        from qurl_mcore.megatron.training import step as optimizer_step

        t = self.cfg.train
        start = time.perf_counter()
        full = self._pad_width(batch)
        local = self._local_rows(full)
        replay = t.routing_replay == "r3"
        self.agreement = torch.zeros(self.hf.num_hidden_layers, 3, dtype=torch.float64, device=self.device) if (
            self.moe and full.routed_experts is not None) else None  # alike on every rank: reduced together
        ref = self._forward_only(self.ref, local) if self.ref is not None else None
        self.measuring = self.agreement is not None
        if replay and self.measuring:
            self._forward_only(self.model, local)  # the trainer's own routing, for the agreement metrics
            self.measuring = False
        prox = self._forward_only(self.model, local, replay=replay) if t.mini_batches > 1 else None
        self.measuring &= prox is None  # else measured by the π_prox pass; otherwise by the first training pass
        t_ref = time.perf_counter()
        capture = self._capture_before()
        self.model.train()
        records, norms, skipped = [], [], 0
        for rows in _parts(len(local), t.mini_batches):
            part = local.select(rows)
            micro = self._micro_batches(part, None if prox is None else prox[rows], None if ref is None else ref[rows])
            out = forward_backward(self.stack, micro, self._loss_forward, seq_length=part.input_ids.shape[1],
                                   micro_batch_size=t.micro_batch_size)
            part_metrics = self._reduce_metrics(out)
            grad_norm, was_skipped = optimizer_step(
                self.stack, t.grad_clip, skip=part_metrics.get("nonfinite", 0.0) > 0 or
                not all(math.isfinite(v) for k, v in part_metrics.items() if k.startswith("loss/")))
            self.measuring = False  # later parts run after an update
            records.append(part_metrics)
            norms.append(grad_norm)
            skipped += was_skipped
        end = time.perf_counter()
        metrics = _mean_over_parts(records)
        metrics.update({
            "train/grad_norm": sum(norms) / len(norms), "train/skipped_nonfinite": skipped / len(norms),
            "train/lr": t.lr, "time/ref_logprobs": t_ref - start, "time/train": end - t_ref,
            "perf/train_tokens_per_s": float(full.attention_mask.sum()) / max(end - start, 1e-9),
            "train/response_tokens": float(full.response_mask.sum()),
        })
        if capture is not None and skipped < len(norms):
            metrics["uaq/update_capture"] = self._capture_after(capture)
        if self.agreement is not None:
            metrics.update(self._routing_metrics())
        if self.taps:
            self.taps.replay(None)  # other forwards of the model (scoring, export checks) route by themselves
        return metrics

    def _routing_metrics(self) -> dict[str, float]:
        """`mismatch/topk_match` and `mismatch/topk_overlap` over every MoE layer and token of the step (all
        ranks' sums; replicas count alike, so the shares are exact), and per layer (`.../layer<n>`)."""
        sums, self.agreement = self.agreement, None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        sums = sums.cpu()  # the step's one read-back of them
        layers = sums[:, 0] > 0
        if not layers.any():
            return {}
        tokens, same, overlap = sums[layers].sum(dim=0).tolist()
        out = {"mismatch/topk_match": same / tokens, "mismatch/topk_overlap": overlap / tokens}
        for n in layers.nonzero().flatten().tolist():
            out[f"mismatch/topk_match/layer{n + 1}"] = float(sums[n, 1] / sums[n, 0])
            out[f"mismatch/topk_overlap/layer{n + 1}"] = float(sums[n, 2] / sums[n, 0])
        return out

    def _local_rows(self, full: TrainBatch) -> TrainBatch:
        """This DP rank's rows; at least one (a fully masked copy of row 0 when there are fewer rows than DP
        ranks), since every rank takes part in the schedule's collectives."""
        local = full.select(slice(self.dp_rank, None, self.dp_size))
        if len(local):
            return local
        empty = full.select(slice(0, 1))
        empty.response_mask = torch.zeros_like(empty.response_mask)
        return empty

    def _reduce_metrics(self, records: list[dict]) -> dict[str, float]:
        """Unit-weighted means of the micro-batches' metrics over this rank and every DP rank ("/max": the
        maximum)."""
        metrics: dict[str, float] = {}
        if records:  # the last pipeline stage's: device tensors, added on the device and read back once
            keys = sorted(k for k in records[0] if k not in ("units", "nonfinite"))
            values = torch.stack([torch.stack([r[k] for k in keys]) for r in records]).to(torch.float64)
            units = torch.stack([r["units"] for r in records]).to(torch.float64)
            bad = torch.stack([r["nonfinite"] for r in records])
            # a micro-batch with non-finite inputs, or none to score, counts 0 in every metric (nothing in a max)
            ok = (~bad & (units > 0))[:, None]
            sums = torch.cat([(units[:, None] * torch.where(ok, values, 0)).sum(0), (units * bad).sum().reshape(1),
                              units.sum().reshape(1)])
            highest = torch.where(ok, values, -math.inf).amax(0)
            if self.dp_size > 1:
                group = self.ps.get_data_parallel_group()
                dist.all_reduce(sums, group=group)
                dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
            read = torch.cat([sums, highest]).tolist()
            n = len(keys)
            total = read[n + 1] or 1.0
            metrics = {k: read[n + 2 + i] if k.endswith("/max") else read[i] / total for i, k in enumerate(keys)}
            metrics["nonfinite"] = read[n] / total
        pp = self.ps.get_pipeline_model_parallel_group()
        if pp.size() > 1:  # only the last stage computed losses: every rank reports (and skips) alike
            box = [metrics]
            dist.broadcast_object_list(box, src=dist.get_global_rank(pp, pp.size() - 1), group=pp, device=self.device)
            metrics = box[0]
        return metrics

    # -- update capture (QuRL §4.3) ---------------------------------------------------------------------------
    def _capture_before(self):
        """The rollout codes' inputs before the update: the weights of the linears the engines quantize."""
        from qurl_mcore.megatron import linear_group, quantized_weights

        engine = self.recipe.engine
        if engine is None or not self.cfg.logging.update_capture:
            return None
        in_scope = lambda name: linear_group(name) in engine.groups  # noqa: E731
        return engine.spec, quantized_weights(self.model, in_scope)

    def _capture_after(self, capture) -> float:
        """Share of rollout-quantized weight codes this update changed (this rank's shards)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron import quantized_weights

        spec, before = capture
        after = quantized_weights(self.model, lambda name: name in before)
        return update_capture_ratio(before, after, spec.fmt, spec.weight_granularity)

    def pid(self) -> int:
        return os.getpid()

    def quantized_linears(self) -> set[str]:
        """HF module names of the linears this rank's model quantizes (the loop checks them)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron import quantized_linears

        return quantized_linears(self.model, self.hf)

    # -- weights for the rollout engines ----------------------------------------------------------------------
    def connect_engines(self, endpoints: list[tuple[str, str | None]]) -> None:
        """Attach to the engines this rank pushes to, given every engine's (url, api key) in engine order:
        colocated, rank i pushes to engine i (they share a node: tensors travel by shared memory or CUDA
        IPC); disaggregated, rank 0 pushes to every engine by broadcast. Called again after a restart."""
        if self.cfg.layout == "colocated":
            self.engine_ids = [self.rank] if self.rank < len(endpoints) else []
        else:
            self.engine_ids = list(range(len(endpoints))) if self.rank == 0 else []
        config = engine_config(self.cfg, self.recipe.engine, str(self.hf_dir), self.device.type)
        self.engines = [HttpEngine(config, endpoints[i][0], api_key=endpoints[i][1]) for i in self.engine_ids]

    def open_weight_group(self, group_name: str, backend: str, timeout: float) -> str:
        """Rank 0, disaggregated: a weight group with every engine's TP ranks, hosted on this node (blocks
        until every engine joined), at the trainer's rendezvous address. Returns the group's address."""
        addr = self.master_addr
        port = free_port(addr)
        self.sender = open_weight_group(self.engines, addr, port, group_name, backend, timeout)
        return f"{addr}:{port}"

    def close_weight_group(self) -> None:
        if self.sender is not None:
            close_weight_group(self.sender, self.engines)
            self.sender = None

    @contextlib.contextmanager
    def weight_stream(self, smoothed: bool = False):
        """The HF-named export of this rank's weights, bucket by bucket in rollout.dtype (UAQ-scaled when UAQ is
        on: the trainer's parameters already are; `smoothed`: with rollout.smoothing's scales folded in, in
        fp32 before the cast); each bucket is gathered just before it goes out. Drained on exit, also after a
        failure: the export gathers shards from every rank (collective)."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.convert import export_cast, export_hf_weights

        r = self.cfg.rollout
        dtype = getattr(torch, r.dtype)
        smoothed = smoothed and r.smoothing > 0
        scales = self._smoothing() if smoothed else None
        raw = export_hf_weights(self.model, self.hf, bucket_bytes=r.push_bucket_mb << 20,
                                dtype=None if smoothed else dtype)
        stream = smooth_buckets(raw, scales, fold_table(self.hf, self.recipe.engine.groups),
                                export_cast(self.hf, dtype)) if smoothed else raw
        try:
            yield stream
        finally:
            for _ in raw:
                pass

    # -- activation smoothing (rollout.smoothing) ------------------------------------------------------------
    def _smoothing(self) -> dict[str, torch.Tensor]:
        """The frozen smoothing scales: restored from the checkpoint, or calibrated on the first call by rank 0
        (`calibration_prompts` through the HF model in fp32 on the host, a layer at a time: `_calibrate`) and sent
        to every rank (collective: every rank pushes at the same time)."""
        if self.smoothing_scales is None:
            box = [self._calibrate() if self.rank == 0 else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
            self.smoothing_scales = box[0]
        return self.smoothing_scales

    def _calibrate(self) -> dict[str, torch.Tensor]:
        """The scales of `qurl_mcore.smoothing.calibrate`, computed on the host one decoder layer at a time
        (`qurl_mcore.layerwise`): the HF model in fp32 would not fit beside this rank's trainer on its GPU, nor a
        large one whole in host memory (4 bytes a parameter: DeepSeek-V3's 2.7 TB)."""
        # transformers only where the scales are calibrated (once a run, rank 0)
        from transformers import AutoTokenizer

        model = LayerwiseModel(self.hf_dir)
        prompts = calibration_prompts(self.cfg, AutoTokenizer.from_pretrained(self.hf_dir))
        return calibrate(model.module, prompts, self.hf, self.recipe.engine.groups, self.cfg.rollout.smoothing,
                         run=model.run)

    def push_weights(self, version: str, only: list[int] | None = None) -> dict[str, float]:
        """Stream this rank's weights to its engines as weight `version` (of `only` those engines, if
        given), one bucket at a time (`weight_stream`): as codes and scales to engines that take them
        (`rollout.push`), and with the refit check after it (`rollout.verify_push`: a RefitMismatch names the
        units that differ and stops the run). Collective: every rank iterates the whole export, also after its
        own engine failed. Returns this rank's time/push (seconds), push/bytes (what it put on the wire: codes
        and scales in a code push) and push/verified_units (units the refit check found equal, its engines
        together); raises EngineFailure naming the engine that failed."""
        start = time.perf_counter()
        sent = [0]
        targets = [k for k, i in enumerate(self.engine_ids) if only is None or i in only]
        failure: Exception | None = None
        with self.weight_stream(smoothed=True) as stream:
            codes = self._code_push()
            # the trainer's quantization of a code push is part of its export: its errors are the trainer's too
            out = _counted(_exported(codes.buckets(stream) if codes is not None else stream), sent)
            checked = 0
            try:
                pushed: list[int] = []
                if self.sender is not None:
                    broadcast_weights(self.sender, self.engines, out, version)
                    pushed = list(range(len(self.engines)))
                elif targets:
                    (k,) = pushed = targets
                    self.engines[k].push_weights((nt for bucket in out for nt in bucket), version,
                                                 bucket_bytes=self.cfg.rollout.push_bucket_mb << 20)
                for k in pushed if codes is not None and self.cfg.rollout.verify_push else ():
                    self.engines[k].verify_push(codes)
                    checked += len(codes.digests)
            except (WeightSpecError, WeightExportError):
                raise  # our export is wrong or failed, or the engine's codes differ: no engine restart fixes that
            except Exception as err:  # noqa: BLE001 - a transport or engine error: that engine restarts
                failure = self._engine_failure(err, targets)
        if failure is not None:
            raise failure
        return {"time/push": time.perf_counter() - start, "push/bytes": float(sent[0]),
                "push/verified_units": float(checked)}

    def _code_push(self) -> CodePush | None:
        """The push's transform (`qurl_mcore.rollout.codes`): codes for engines that take them, else the digests of
        `rollout.verify_push` alone; None for full-precision engines or with neither."""
        options = self.engines[0].config.options() if self.engines else None
        if options is None or not (options.codes or self.cfg.rollout.verify_push):
            return None
        if self._units is None:
            engine = self.engines[0]
            self._units = engine_units(self.hf, options.recipe.groups, engine.tp_size, engine.ep_size)
        return CodePush(options.recipe.spec, self._units, send=options.codes, quantizer=REQUANTS[options.requant],
                        verify=self.cfg.rollout.verify_push)

    def _engine_failure(self, err: Exception, targets: list[int]) -> EngineFailure:
        """The EngineFailure of a push to `targets` (indices into `self.engines`) that raised `err`: the engine
        the error names, else the only target, else (a broadcast whose group broke) the first target that no
        longer answers. When every target still answers, the fault is on this side: RuntimeError."""
        k = err.engine if isinstance(err, WeightPushError) and err.engine is not None else None
        if k is None and len(targets) == 1:
            k = targets[0]
        if k is None:
            k = next((t for t in targets if not _answers(self.engines[t])), None)
        if k is None:
            raise RuntimeError(f"weight push failed while every engine still answers: {type(err).__name__}: "
                               f"{err}"[:2000]) from err
        return EngineFailure(self.engine_ids[k], f"weight push: {type(err).__name__}: {err}"[:2000])

    def push_reference(self, endpoint: tuple[str, str | None], version: str) -> float:
        """Collective, like `push_weights`: the weights, as weight `version`, to the BF16 reference engine at
        `endpoint` (eval.bf16_reference; it shares rank 0's bundle, and rank 0 sends). Returns the seconds
        taken; raises EngineFailure naming it (engine number rollout.engines) when the push fails."""
        start = time.perf_counter()
        with self.weight_stream() as stream:
            stream = _exported(stream)
            try:
                if self.rank == 0:
                    engine = HttpEngine(reference_engine_config(self.cfg, str(self.hf_dir), self.device.type),
                                        endpoint[0], api_key=endpoint[1])
                    engine.push_weights((nt for bucket in stream for nt in bucket), version,
                                        bucket_bytes=self.cfg.rollout.push_bucket_mb << 20)
            except (WeightSpecError, WeightExportError):
                raise
            except Exception as err:  # noqa: BLE001 - a transport or engine error: the reference engine restarts
                reason = f"weight push: {type(err).__name__}: {err}"[:2000]
                raise EngineFailure(self.cfg.rollout.engines, reason) from None
        return time.perf_counter() - start

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's model shards and optimizer state."""
        from qurl_mcore.megatron.training import optimizer_state

        return {"model": self.model.state_dict(), "optimizer": optimizer_state(self.stack),
                "config": asdict(self.cfg.train), **self._smoothing_state()}

    def _smoothing_state(self) -> dict[str, Any]:
        """rollout.smoothing's scales, once calibrated, for a resume to restore (`load_state`)."""
        return {} if self.smoothing_scales is None else {"smoothing": self.smoothing_scales}

    def load_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        mismatch = ckpt.tensor_mismatch(state["model"], self.model.state_dict())
        if mismatch:  # torch would only say "Error(s) in loading state_dict"
            raise ValueError(f"{source} holds another model or layout: resume with the model.path, precision and "
                             f"train.tp_size/pp_size/ep_size it was written with, or start anew in another "
                             f"checkpoint.dir ({mismatch})")
        self.model.load_state_dict(state["model"])
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.training import load_optimizer_state

        load_optimizer_state(self.stack, state["optimizer"])
        self.smoothing_scales = state.get("smoothing")  # a checkpoint without them: calibrated at the next push

    def save_checkpoint(self, root: str, step: int) -> list[dict[str, Any]]:
        """Write this rank's state into step `step`'s partial checkpoint (here, not through the driver), in
        checkpoint.format: torch_dist, its slices of the training state and its random generators
        (collective over the trainer's ranks), or torch, its own file. Returns the records of the files it
        wrote, for `checkpoint.finalize`; with checkpoint.async_save the slices are still being written, and
        `finish_checkpoint` returns theirs."""
        if self.cfg.checkpoint.format == "torch":
            return [ckpt.write_file(root, step, ckpt.rank_file(self.rank), self.state())]
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.dist_checkpoint import save, sharded_state

        partial = ckpt.partial_dir(root, step)
        (partial / ckpt.TRAINER_DIR).mkdir(parents=True, exist_ok=True)
        state = {**sharded_state(self.stack), "rng": self._rng_shard()}
        records = []
        with _space_named(partial):
            if self.cfg.checkpoint.async_save:
                self.background_save.start(state, partial / ckpt.TRAINER_DIR)
            else:
                records = _trainer_records(partial / ckpt.TRAINER_DIR, save(state, partial / ckpt.TRAINER_DIR))
        if self.rank == 0 and self.smoothing_scales is not None:  # alike on every rank: one copy
            records.append(ckpt.write_file(root, step, SMOOTHING_FILE, self._smoothing_state()))
        return records

    def finish_checkpoint(self) -> list[dict[str, Any]]:
        """Collective: wait until every rank's files of the save in flight (checkpoint.async_save) are
        written; the records of this rank's ([] when no save is in flight)."""
        directory = self.background_save.directory
        if directory is None:
            return []
        with _space_named(directory.parent):
            return _trainer_records(directory, self.background_save.wait())

    def _rng_shard(self):
        """This rank's random generators as its slice of a per-rank object (Megatron-LM's "rng_state"): loaded
        back only by the same layout, where rank r continues rank r's sequences."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state = {**ckpt.rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)

    def export_hf(self, out_dir: str) -> str | None:
        """Collective: the model as an HF checkpoint in `out_dir` (UAQ undone), written by rank 0."""
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron.export import write_hf_checkpoint

        out = write_hf_checkpoint(self.model, self.hf_dir, out_dir,
                                  uaq_scale=self.cfg.uaq.scale if self.cfg.uaq.enabled else None,
                                  uaq_scope=self.cfg.uaq_scope() or "all")
        return None if out is None else str(out)

    def load_checkpoint(self, path: str) -> None:
        """Load this rank's state from a published (verified) checkpoint in either format (its meta.json
        says which). A torch_dist checkpoint loads on any parallel layout (collective); its random generators
        only on the layout that wrote it (another layout starts them from the run's seed)."""
        meta = ckpt.read_meta(path)
        if ckpt.format_of(meta) == "torch":
            self.load_state(ckpt.read_file(path, ckpt.rank_file(self.rank)), source=path)
            return
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from qurl_mcore.megatron.dist_checkpoint import load_training

        t, saved = self.cfg.train, meta["config"]["train"]
        same_layout = meta["world_size"] == dist.get_world_size() and all(
            saved[k] == getattr(t, k) for k in ("tp_size", "pp_size", "ep_size", "dp_size"))
        try:
            loaded = load_training(self.stack, os.path.join(path, ckpt.TRAINER_DIR),
                                   {"rng": self._rng_shard()} if same_layout else {})
        except CheckpointingException as err:  # e.g. a tensor the checkpoint lacks or holds in another shape
            raise ValueError(f"{path} holds another model: resume with the model.path and precision it was "
                             f"written with, or start anew in another checkpoint.dir ({err})") from None
        if same_layout:
            ckpt.set_rng_state(loaded["rng"])
            get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
        smoothing = os.path.join(path, SMOOTHING_FILE)
        # a checkpoint without them: calibrated at the next push
        self.smoothing_scales = ckpt.read_file(path, SMOOTHING_FILE)["smoothing"] if os.path.isfile(smoothing) else None

    def empty_cache(self) -> None:
        """Hand the allocator's cached blocks back to the GPU, for an engine on the same one to resume into."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        # Megatron-Core stays out of the driver, which imports this module (actors.py)
        from qurl_mcore.megatron import destroy_parallel

        self.close_weight_group()
        destroy_parallel()


#: the file of a torch_dist checkpoint holding rollout.smoothing's frozen scales (the same on every rank)
SMOOTHING_FILE = "smoothing.pt"
#: prompts the smoothing scales are calibrated on: the first the run takes (rollout.smoothing)
CALIBRATION_PROMPTS = 64


def _trainer_records(directory: Path, names: list[str]) -> list[dict[str, Any]]:
    """The checkpoint records of files `names` that Megatron wrote into `directory` (a checkpoint's trainer/)."""
    return ckpt.hash_files(directory.parent, [f"{directory.name}/{name}" for name in names])


def calibration_prompts(cfg: Config, tokenizer) -> list[torch.Tensor]:
    """The token ids of the first `CALIBRATION_PROMPTS` prompts the run takes (the prompt set's order of its
    first steps, `prompt_indices`), as the engines see them (chat template, data.system_prompt)."""
    examples = load_prompt_set(cfg)
    chosen = prompt_indices(len(examples), 0, min(CALIBRATION_PROMPTS, len(examples)), cfg.seed)
    return [torch.tensor(chat_ids(tokenizer, examples[i], cfg.data.system_prompt)) for i in chosen]


def _parts(rows: int, parts: int) -> list[slice]:
    """`parts` consecutive slices of `rows` rows, as equal as can be (none empty while rows allow)."""
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [slice(0, rows)]


def _mean_over_parts(records: list[dict[str, float]]) -> dict[str, float]:
    """The mini-batches' metrics, averaged (their "/max" metrics: the maximum); "nonfinite" is dropped (the
    step reports skipped updates itself)."""
    keys = {k for r in records for k in r if k != "nonfinite"}
    return {k: max(r[k] for r in records if k in r) if k.endswith("/max") else
            sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in keys}


class WeightExportError(RuntimeError):
    """This rank's own export of its weights failed (a missing tensor, out of memory while gathering or folding
    the smoothing scales): the trainer's fault, which ends the run; no engine restart fixes it."""


def _exported(stream):
    """The buckets of `stream` (a `weight_stream`), an error raised while making one re-raised as
    WeightExportError: the consumers of a push (an engine client, a broadcast) see it as theirs otherwise."""
    try:
        yield from stream
    except Exception as err:  # noqa: BLE001 - every error of the export is the trainer's
        raise WeightExportError(f"exporting this rank's weights: {type(err).__name__}: {err}"[:2000]) from err


def _counted(stream, sent: list[int]):
    """The buckets of `stream`, their bytes added to `sent[0]` as they are taken (the bytes a push put on the
    wire: codes and scales for a code push)."""
    for bucket in stream:
        sent[0] += sum(t.nbytes for _, t in bucket)
        yield bucket


def _answers(engine) -> bool:
    """Whether `engine` still answers a request (its model info)."""
    try:
        engine.model_info()
    except Exception:  # noqa: BLE001 - any failure to answer
        return False
    return True


def _refuse_non_finite(model: torch.nn.Module, source: str) -> None:
    """ValueError naming the first parameter of `model`, just loaded from `source`, that holds a NaN or an
    infinity: every step would be skipped and every rollout's log-probs be NaN."""
    for name, p in model.named_parameters():
        bad = int((~torch.isfinite(p)).sum())
        if bad:
            raise ValueError(f"{source}: weight {name} holds {bad} non-finite value(s) (NaN or Inf) of {p.numel()}; "
                             "the model cannot train from it: fix or replace the checkpoint")


@contextlib.contextmanager
def _space_named(partial: Path):
    """Megatron's distributed save into step directory `partial`: a full disk (which it reports as a short
    write, "unexpected pos", in torch's `CheckpointException`, a BaseException) raised as `checkpoint.no_space`,
    with the partial directory removed."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:
        if not ckpt.out_of_space(err, partial):
            raise
        shutil.rmtree(partial, ignore_errors=True)  # every rank: whatever each of them wrote
        raise ckpt.no_space(partial) from None
