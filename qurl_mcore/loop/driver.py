"""`qurl train`: the QuRL loop, one RL step after another (slime-style: the driver only sequences actors).

One step:
  rollout     the engines sample n responses per prompt with the quantized actor → behaviour log-probs;
              rewards (a reward that raises scores 0 and is counted)
  advantages  GRPO or RLOO per prompt group; DAPO's dynamic sampling drops groups with equal rewards
  train       Megatron: the policy loss (ACR, ...) with π_prox read off the training forward (one optimizer
              step per batch, so the pre-update weights are π_prox), π_ref when the KL term is on; the step
              is skipped, and reported, on a non-finite loss or gradient
  push        the trainer's (UAQ-scaled) weights go to every engine, which re-quantizes them
  log         metrics.jsonl + TensorBoard (+ W&B); a checkpoint every `checkpoint.every` steps and on SIGTERM

A crashed engine is restarted, loaded with the current weights, and the step's rollout retried
(`rollout.restart_attempts` times). Resuming reloads the latest checkpoint: model, optimizer, RNG, step (the
prompt order is a function of the step), and pushes the weights before the first rollout.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qurl_mcore.config import Config, to_dict
from qurl_mcore.rl.advantages import dynamic_sampling_mask, grpo_advantages, rloo_advantages

from . import checkpoint as ckpt
from .batch import Sample, collate
from .report import write_report
from .tracking import MetricsLog


@dataclass
class RunResult:
    steps_done: int  # the step the run reached (the next one to do)
    stopped: bool  # by a signal, with a checkpoint written
    log_dir: Path
    report: Path | None


def advantages(cfg: Config, samples: list[Sample]) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
    """Per-sample advantages (samples are n per group, group after group); with dynamic sampling the groups
    whose rewards are all equal are dropped (their advantage is 0: no signal)."""
    n = cfg.rollout.samples_per_prompt
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if cfg.train.advantage == "grpo":
        adv = grpo_advantages(rewards, n, scale_by_std=cfg.train.scale_by_std)
    else:
        adv = rloo_advantages(rewards, n)
    keep = dynamic_sampling_mask(rewards, n)
    metrics = {"rollout/groups_with_signal": float(keep.float().mean())}
    if cfg.train.dynamic_sampling:
        if not keep.any():
            return [], adv[:0], metrics
        rows = keep.repeat_interleave(n)
        samples = [s for s, k in zip(samples, rows.tolist()) if k]
        adv = adv[rows]
    return samples, adv, metrics


BROADCAST_TIMEOUT_S = 600.0  # how long a broadcast waits for a stalled peer before failing the push


class Loop:
    """The actors of one run and the step sequence over them."""

    def __init__(self, cfg: Config):
        import ray

        from .actors import start_actors
        from .trainer import resolve_model_path

        self.cfg = cfg
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.trainers, self.hosts, self.manager, self.pg = start_actors(cfg, self.model_path)
        self.ray = ray
        self.engine_restarts = 0
        self.group: str | None = None  # the weight broadcast group (disaggregated layout)
        self.groups_opened = 0
        if cfg.layout == "disaggregated":
            self.open_group()

    # -- weights and engine recovery ------------------------------------------------------------------------
    def open_group(self) -> None:
        """The disaggregated layout pushes by broadcast: the trainer's rank 0 and every engine's TP ranks
        form one group (NCCL on GPUs, gloo on CPUs), hosted at rank 0's node."""
        ray = self.ray
        backend = "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "gloo"
        self.groups_opened += 1
        self.group = f"qurl-weights-{self.groups_opened}"
        addr, port = ray.get(self.trainers[0].rendezvous.remote())
        ray.get(self.manager.open_group.remote(self.trainers[0], addr, port, self.group, backend,
                                               BROADCAST_TIMEOUT_S))
        print(f"qurl train: weights go to the engines by {backend} broadcast ({self.group} at {addr}:{port})",
              file=sys.stderr)

    def close_group(self) -> None:
        if self.group is not None:
            self.ray.get([self.manager.leave_group.remote(self.group), self.trainers[0].close_weight_group.remote()])
            self.group = None

    def _push(self, version: str, only: list[int] | None = None) -> float:
        """Export from every trainer rank (collective), then rank 0's buckets go to the engines: through the
        object store (colocated; only the engines in `only`, if given) or by broadcast (every engine)."""
        ray = self.ray
        start = time.perf_counter()
        bucket_bytes = self.cfg.rollout.push_bucket_mb << 20
        if self.group is not None:
            specs = ray.get([t.stage_weights.remote(bucket_bytes) for t in self.trainers])[0]
            ray.get(self.manager.broadcast.remote(self.trainers[0], specs, version, self.group))
        else:
            refs = [t.export.remote(bucket_bytes) for t in self.trainers]
            done = self.manager.push.remote([refs[0]], version, only)
            ray.get(refs[1:] + [done])
        return time.perf_counter() - start

    def recovering(self, action, version: str):
        """`action()`, retried after restarting a failed engine and loading it with the trainer's current
        weights (tagged `version`), at most `rollout.restart_attempts` times."""
        from .rollout import EngineFailure

        attempts = self.cfg.rollout.restart_attempts
        for attempt in range(attempts + 1):
            try:
                return action()
            except Exception as err:  # noqa: BLE001 - Ray wraps the manager's EngineFailure
                failure = getattr(err, "cause", err)
                if not isinstance(failure, EngineFailure) or attempt == attempts:
                    raise
                print(f"qurl train: {failure}; restarting it ({attempt + 1}/{attempts})", file=sys.stderr)
                self.engine_restarts += 1
                try:
                    self.ray.get(self.manager.restart.remote(failure.index))
                    if self.group is not None:  # the new engine joins a new group with the others
                        self.close_group()
                        self.open_group()
                    self._push(version, only=[failure.index])
                except Exception as again:  # noqa: BLE001 - counts as the next attempt's failure
                    print(f"qurl train: restarting engine {failure.index} failed: {again}", file=sys.stderr)
                self.write_engines()
        raise AssertionError("unreachable")

    def push(self, version: str) -> float:
        return self.recovering(lambda: self._push(version), version)

    def rollout(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples (a failed engine is restarted with the current weights and the rollout retried)."""
        return self.recovering(lambda: self.ray.get(self.manager.generate.remote(step)), f"step-{step}")

    def write_engines(self) -> None:
        """logging.dir/engines.json: the engine servers' process ids (operators, and the engine-kill test)."""
        path = Path(self.cfg.logging.dir) / "engines.json"
        path.write_text(json.dumps({"pids": self.ray.get(self.manager.pids.remote())}))

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        states = self.ray.get([t.state.remote() for t in self.trainers])
        for rank, state in enumerate(states):
            extra = {"rng": ckpt.rng_state()} if rank == 0 else {}
            ckpt.write_rank(self.cfg.checkpoint.dir, step, rank, {**state, **extra})
        meta = {"config": to_dict(self.cfg), "engine_restarts": self.engine_restarts}
        return ckpt.finalize(self.cfg.checkpoint.dir, step, len(self.trainers), meta, keep=self.cfg.checkpoint.keep)

    def restore(self) -> int:
        """Load the latest checkpoint, if any; returns the step to continue from."""
        path = ckpt.latest_checkpoint(self.cfg.checkpoint.dir)
        if path is None:
            return 0
        meta, _ = ckpt.read_rank(path, 0)
        if meta["world_size"] != len(self.trainers):
            raise RuntimeError(f"{path} was written by {meta['world_size']} trainer ranks, this run has "
                               f"{len(self.trainers)}; resume with the same train.tp_size/dp_size")
        states = [ckpt.read_rank(path, rank)[1] for rank in range(len(self.trainers))]
        self.ray.get([t.load_state.remote(s) for t, s in zip(self.trainers, states)])
        ckpt.set_rng_state(states[0]["rng"])
        self.engine_restarts = meta.get("engine_restarts", 0)
        return meta["step"]

    # -- one step -------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        samples, metrics = self.rollout(step)
        samples, adv, adv_metrics = advantages(self.cfg, samples)
        metrics.update(adv_metrics)
        t_train = time.perf_counter()
        if samples:
            batch = collate(samples, adv, pad_id=0)
            results = self.ray.get([t.step.remote(batch) for t in self.trainers])
            metrics.update(results[0])
        else:
            metrics["train/skipped"] = 1.0  # no group carried a learning signal
        t_push = time.perf_counter()
        metrics["time/push"] = self.push(f"step-{step + 1}")
        end = time.perf_counter()
        metrics.update({"time/train_step": t_push - t_train, "time/step": end - start,
                        "rollout/engine_restarts": float(self.engine_restarts)})
        return metrics

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        try:
            ray.get([h.shutdown.remote() for h in self.hosts], timeout=120)
            ray.get([t.close.remote() for t in self.trainers], timeout=120)
        finally:
            for actor in [*self.trainers, *self.hosts, self.manager]:
                ray.kill(actor)
            remove_placement_group(self.pg)


def _progress(cfg: Config, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="qurl train", unit="step", disable=not cfg.logging.progress,
                file=sys.stderr, dynamic_ncols=True)


def run(cfg: Config, address: str | None = None) -> RunResult:
    """Train for `cfg.steps` steps (resuming from `cfg.checkpoint.dir` when it holds a checkpoint). `address`
    joins an existing Ray cluster (default: $RAY_ADDRESS, else a local one)."""
    import ray

    from .checkpoint import StopRequest

    owns_ray = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS")  # an existing cluster brings its own node tags
    if owns_ray:
        # "local": never attach to a cluster some earlier `ray start` left behind on this machine
        ray.init(address=address or "local", resources=None if address else {"qurl_train": 1, "qurl_rollout": 1},
                 log_to_driver=True, include_dashboard=False)
    stop = StopRequest()  # after ray.init, whose own SIGTERM handler would abort the driver
    torch.manual_seed(cfg.seed)
    log = MetricsLog(cfg.logging.dir, wandb_project=cfg.logging.wandb_project, run_config=to_dict(cfg))
    loop = Loop(cfg)
    try:
        loop.write_engines()
        step = loop.restore()
        if step:
            print(f"qurl train: resuming at step {step} from {cfg.checkpoint.dir}", file=sys.stderr)
        log.truncate(step)  # records of steps done after the checkpoint are redone
        loop.push(f"step-{step}")  # UAQ-scaled or resumed weights replace the checkpoint the engines loaded
        bar = _progress(cfg, step)
        while step < cfg.steps and not stop.requested:
            metrics = loop.step(step)
            step += 1
            log.log(step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            tok_s=f"{metrics['perf/rollout_tokens_per_s']:.0f}", refresh=False)
            if metrics.get("train/skipped") and "train/grad_norm" in metrics:
                print(f"qurl train: step {step} skipped: non-finite loss or gradient "
                      f"(grad norm {metrics['train/grad_norm']})", file=sys.stderr)
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                loop.save(step)
        bar.close()
        if stop.requested and step < cfg.steps:
            loop.save(step)
            print(f"qurl train: {stop.signal_name} at step {step}: checkpoint written, exiting", file=sys.stderr)
    finally:
        log.close()
        loop.close()
        if owns_ray:
            ray.shutdown()
    report = write_report(log.path, cfg.logging.dir) if log.path.exists() else None
    return RunResult(step, stop.requested, Path(cfg.logging.dir), report)
