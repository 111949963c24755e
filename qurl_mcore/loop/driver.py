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
import logging
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
        from qurl_mcore.models import resolve_model_path

        self.cfg = cfg
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.trainers, self.hosts, self.manager, self.pg = start_actors(cfg, self.model_path)
        self.ray = ray
        self.engine_restarts = 0
        self.groups_opened = 0  # weight broadcast groups (disaggregated layout), one more after each restart
        self.connect()

    # -- weights and engine recovery ------------------------------------------------------------------------
    def connect(self) -> None:
        """Give the trainer ranks the engines' endpoints; in the disaggregated layout rank 0 then opens a
        weight group with every engine's TP ranks (NCCL on GPUs, gloo on CPUs), hosted on its node."""
        ray = self.ray
        endpoints = ray.get(self.manager.endpoints.remote())
        ray.get([t.connect_engines.remote(endpoints) for t in self.trainers])
        if self.cfg.layout == "disaggregated":
            backend = "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "gloo"
            self.groups_opened += 1
            where = ray.get(self.trainers[0].open_weight_group.remote(f"qurl-weights-{self.groups_opened}", backend,
                                                                      BROADCAST_TIMEOUT_S))
            say(f"weights go to the engines by {backend} broadcast (group at {where})")

    def check_symmetry(self) -> None:
        """Refuse to train unless the engines and the trainer quantize exactly the linears the precision
        table says (`qurl_mcore.precision.quantized_linears`)."""
        from qurl_mcore.precision import quantized_linears

        precision, scope, _ = self.cfg.resolved_precision()
        engines = self.ray.get(self.manager.quantized_linears.remote())
        trainer = set().union(*self.ray.get([t.quantized_linears.remote() for t in self.trainers]))
        problems = []
        want = quantized_linears(self.model_path, precision.name, scope, side="rollout")
        for i, got in enumerate(engines):
            if got != want:
                problems.append(f"engine {i} quantizes {len(got)} linears, the table {len(want)} "
                                f"(e.g. {sorted(got ^ want)[:3]})")
        want = quantized_linears(self.model_path, precision.name, scope, side="train")
        if trainer != want:
            problems.append(f"the trainer quantizes {len(trainer)} linears, the table {len(want)} "
                            f"(e.g. {sorted(trainer ^ want)[:3]})")
        if problems:
            raise RuntimeError(f"precision {precision.name!r}, scope {scope!r}: " + "; ".join(problems))

    def push(self, version: str, only: list[int] | None = None) -> float:
        """Every trainer rank streams its weights to its engines (collective); returns the seconds taken."""
        return max(self.ray.get([t.push_weights.remote(version, only) for t in self.trainers]))

    def recovering(self, action, version: str):
        """`action()`, retried after restarting a failed engine and loading it with the trainer's current
        weights (tagged `version`), at most `rollout.restart_attempts` times."""
        from .rollout import EngineFailure

        attempts = self.cfg.rollout.restart_attempts
        for attempt in range(attempts + 1):
            try:
                return action()
            except Exception as err:  # noqa: BLE001 - Ray wraps the actors' EngineFailure
                failure = getattr(err, "cause", err)
                if not isinstance(failure, EngineFailure) or attempt == attempts:
                    raise
                say(f"{failure}; restarting it ({attempt + 1}/{attempts})")
                self.engine_restarts += 1
                try:
                    self.ray.get(self.manager.restart.remote(failure.index))
                    if self.cfg.layout == "disaggregated":  # the new engine joins a new group with the others
                        self.ray.get(self.trainers[0].close_weight_group.remote())
                        self.connect()
                        self.push(version)
                    else:
                        self.connect()
                        self.push(version, only=[failure.index])
                except Exception as again:  # noqa: BLE001 - counts as the next attempt's failure
                    say(f"restarting engine {failure.index} failed: {again}")
                self.write_engines()
        raise AssertionError("unreachable")

    def push_all(self, version: str) -> float:
        return self.recovering(lambda: self.push(version), version)

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
            metrics["train/skipped_nonfinite"] = 0.0
        t_push = time.perf_counter()
        metrics["time/push"] = self.push_all(f"step-{step + 1}")
        end = time.perf_counter()
        metrics.update({"time/train_step": t_push - t_train, "time/step": end - start,
                        "train/skipped_no_signal": float(not samples),  # dynamic sampling dropped every group
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


def say(message: str) -> None:
    """One line on the console for a notable event, above the progress bar."""
    from tqdm import tqdm

    tqdm.write(f"qurl train: {message}", file=sys.stderr)


def _progress(cfg: Config, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="qurl train", unit="step", disable=not cfg.logging.progress,
                file=sys.stderr, dynamic_ncols=True)


def run(cfg: Config, address: str | None = None) -> RunResult:
    """Train for `cfg.steps` steps (resuming from `cfg.checkpoint.dir` when it holds a checkpoint). `address`
    joins an existing Ray cluster (default: $RAY_ADDRESS, else a local one). Raises ConfigError listing
    every problem `qurl_mcore.preflight` finds, before anything starts.

    The console gets the progress bar and one line per notable event; everything the actors print (and the
    driver's Python warnings) goes to files in `logging.dir` (driver.log, trainer-<rank>.log, engine-<i>.log,
    rollout-manager.log)."""
    import ray

    from qurl_mcore.config import ConfigError
    from qurl_mcore.preflight import preflight

    from .checkpoint import StopRequest
    from .tracking import warnings_to_file

    checked = preflight(cfg)
    if not checked.ok:
        raise ConfigError(checked.report())
    logs = Path(cfg.logging.dir)
    warnings_to_file(logs / "driver.log")
    precision, scope, _ = cfg.resolved_precision()
    say(f"{cfg.steps} steps of {cfg.model.path}, precision {precision.name} (scope {scope}), {cfg.layout}, "
        f"{cfg.train.tp_size * cfg.train.dp_size} trainer rank(s), {cfg.rollout.engines} engine(s); logs in {logs}")
    owns_ray = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS")  # an existing cluster brings its own node tags
    if owns_ray:
        # "local": never attach to a cluster some earlier `ray start` left behind on this machine
        ray.init(address=address or "local", resources=None if address else {"qurl_train": 1, "qurl_rollout": 1},
                 log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
    stop = StopRequest()  # after ray.init, whose own SIGTERM handler would abort the driver
    torch.manual_seed(cfg.seed)
    log = MetricsLog(logs, wandb_project=cfg.logging.wandb_project, run_config=to_dict(cfg))
    loop = Loop(cfg)
    try:
        loop.write_engines()
        step = loop.restore()
        if step:
            say(f"resuming at step {step} from {cfg.checkpoint.dir}")
        log.truncate(step)  # records of steps done after the checkpoint are redone
        loop.check_symmetry()
        loop.push_all(f"step-{step}")  # UAQ-scaled or resumed weights replace the checkpoint the engines loaded
        bar = _progress(cfg, step)
        while step < cfg.steps and not stop.requested:
            metrics = loop.step(step)
            step += 1
            log.log(step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            tok_s=f"{metrics['perf/rollout_tokens_per_s']:.0f}", refresh=False)
            if metrics.get("train/skipped_nonfinite"):
                say(f"step {step} skipped: non-finite loss or gradient (grad norm {metrics['train/grad_norm']})")
            if metrics.get("train/skipped_no_signal"):
                say(f"step {step} skipped: every prompt group had equal rewards (no learning signal)")
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                say(f"checkpoint {loop.save(step)}")
        bar.close()
        if stop.requested and step < cfg.steps:
            path = loop.save(step)
            say(f"{stop.signal_name} at step {step}: checkpoint {path} written, exiting")
    finally:
        log.close()
        loop.close()
        if owns_ray:
            ray.shutdown()
    report = write_report(log.path, cfg.logging.dir) if log.path.exists() else None
    return RunResult(step, stop.requested, Path(cfg.logging.dir), report)
