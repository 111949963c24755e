"""`qurl train`: the QuRL loop, one RL step after another (slime-style: the driver only sequences actors).

One step:
  rollout     the engines sample n responses per prompt with the quantized actor → behaviour log-probs;
              rewards (a reward that raises scores 0 and is counted)
  advantages  GRPO or RLOO per prompt group; DAPO's dynamic sampling drops groups with equal rewards
  train       Megatron: the policy loss (ACR, ...) with π_prox read off the training forward (one optimizer
              step per batch, so the pre-update weights are π_prox), π_ref when the KL term is on; the step
              is skipped, and reported, on a non-finite loss or gradient
  push        the trainer's (UAQ-scaled) weights go to every engine, which re-quantizes them
  eval        every `eval.every` steps, after the last and before the first (step 0): held-out accuracy of the
              rollout engines and of a BF16 engine with the same weights (evaluation.py)
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
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch
from ray.util.placement_group import remove_placement_group
from tqdm import tqdm

from qurl_mcore import checkpoint as ckpt
from qurl_mcore.config import Config, ConfigError, flatten, to_dict
from qurl_mcore.models import resolve_model_path
from qurl_mcore.parent_death import descendants, start_reaper, stop_survivors
from qurl_mcore.precision import quantized_linears
from qurl_mcore.preflight import preflight
from qurl_mcore.provenance import code_version
from qurl_mcore.rl.advantages import dynamic_sampling_mask, grpo_advantages, rloo_advantages
from qurl_mcore.runlock import lock_dirs

from .actors import start_actors
from .batch import Sample, collate
from .outcome import RunFailure, StopOverdue, StopRequest, shielded_children
from .report import write_report
from .sampler import EngineFailure
from .tracking import MetricsLog, warnings_to_file


@dataclass
class RunResult:
    steps_done: int  # the step the run reached (the next one to do)
    stopped: bool  # by a signal: with a checkpoint, unless the step in progress outlasted checkpoint.stop_grace_s
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


#: seconds Ray's processes (and what the run's actors started) get to end after `ray.shutdown` before they are
#: killed: its agents watch their raylet and leave only when they notice it is gone
RAY_EXIT_GRACE_S = 10.0

DRIVER_FILE = "driver.pt"  # the driver's part of a checkpoint: its random generators


class Loop:
    """The actors of one run (groups.py: the trainer ranks, the rollout engines) and the step sequence over them."""

    def __init__(self, cfg: Config, stop=None):
        self.cfg = cfg
        self.ray = ray
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.offload = cfg.offload_rollout(ray.cluster_resources().get("GPU", 0) > 0)
        self.trainers, self.rollouts, self.pg = start_actors(cfg, self.model_path, stop)
        self.engine_restarts = 0
        self.in_flight: tuple[int, list[dict], dict] | None = None  # the checkpoint being written: step, files, meta
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote
        self.groups_opened = 0  # weight broadcast groups (disaggregated layout), one more after each restart
        try:
            self.connect()
        except BaseException as err:
            self.close()
            if isinstance(err, EngineFailure):
                raise RunFailure(f"{err} while starting; see {cfg.logging.dir}/engine-{err.index}.log") from None
            raise

    # -- weights and engine recovery ------------------------------------------------------------------------
    def connect(self) -> None:
        """Give the trainer ranks the engines' endpoints; in the disaggregated layout rank 0 then opens a
        weight group with every engine's TP ranks (NCCL on GPUs, gloo on CPUs), hosted on its node."""
        self.trainers.connect_engines(self.rollouts.endpoints())
        if self.cfg.layout == "disaggregated":
            backend = "nccl" if self.ray.cluster_resources().get("GPU", 0) > 0 else "gloo"
            self.groups_opened += 1
            where = self.trainers.open_weight_group(f"qurl-weights-{self.groups_opened}", backend=backend,
                                                    timeout=self.cfg.rollout.broadcast_timeout_s)
            say(f"weights go to the engines by {backend} broadcast (group at {where})")

    def check_symmetry(self) -> None:
        """Refuse to train unless the engines and the trainer quantize exactly the linears the precision
        table says (`qurl_mcore.precision.quantized_linears`)."""
        precision, scope, _ = self.cfg.resolved_precision()
        engines = self.rollouts.quantized_linears()
        trainer = self.trainers.quantized_linears()
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

    def recovering(self, action, version: str):
        """`action()`, retried after restarting a failed engine and loading it with the trainer's current
        weights (tagged `version`), at most `rollout.restart_attempts` times."""
        attempts = self.cfg.rollout.restart_attempts
        for attempt in range(attempts + 1):
            try:
                return action()
            except EngineFailure as failure:  # only an engine's failure restarts the engine
                if attempt == attempts:
                    raise RunFailure(f"{failure}, still after {attempts} restart(s); see "
                                     f"{self.cfg.logging.dir}/engine-{failure.index}.log") from None
                say(f"{failure}; restarting it ({attempt + 1}/{attempts})")
                self.engine_restarts += 1
                try:
                    self.rollouts.restart(failure.index)
                    if self.cfg.layout == "disaggregated":  # the new engine joins a new group with the others
                        self.trainers.close_weight_group()
                        self.connect()
                        self.trainers.push_weights(version)
                    else:
                        self.connect()
                        self.trainers.push_weights(version, only=[failure.index])
                except EngineFailure as again:  # counts as the next attempt's failure
                    say(f"restarting engine {failure.index} failed: {again}")
                self.write_pids()
        raise AssertionError("unreachable")

    def push_all(self, version: str) -> dict[str, float]:
        """Every engine gets the trainer's weights as `version` (restarting failed ones); returns the push's
        metrics (`TrainerGroup.push_weights`).
        With rollout.offload the engines take back their weights' memory first (the trainer empties its
        allocator's cache for it) and their KV cache and CUDA graphs after."""
        def push() -> dict[str, float]:
            if not self.offload:
                return self.trainers.push_weights(version)
            self.trainers.empty_cache()
            self.rollouts.resume_memory(["weights"])
            pushed = self.trainers.push_weights(version)
            self.rollouts.resume_memory(["kv_cache", "cuda_graph"])
            return pushed

        return self.recovering(push, version)

    def rollout(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples (a failed engine is restarted with the current weights and the rollout retried)."""
        return self.recovering(lambda: self.rollouts.generate(step), f"step-{step}")

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out eval/* metrics (evaluation.py) of the weights the engines hold after `step` steps: on
        the rollout engines, then (eval.bf16_reference) on the BF16 reference engine, which gets the same
        weights first; it serves nothing else, so it is pushed to only here. A failed engine, the reference
        one too, is restarted and the evaluation retried, as a rollout is."""
        start = time.perf_counter()
        version = f"step-{step}"
        metrics = self.recovering(lambda: self.rollouts.evaluate(step), version)
        if self.cfg.eval.bf16_reference:
            metrics.update(self.recovering(lambda: self.evaluate_reference(step), version))
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    def evaluate_reference(self, step: int) -> dict[str, float]:
        """Push the weights of `step` to the reference engine and evaluate it; with rollout.offload it holds
        its memory only meanwhile."""
        version = f"step-{step}"
        endpoint = self.rollouts.reference_endpoint()
        if self.offload:
            self.trainers.empty_cache()
            self.rollouts.resume_memory(["weights"], reference=True)
        self.trainers.push_reference(endpoint, version)
        if self.offload:
            self.rollouts.resume_memory(["kv_cache", "cuda_graph"], reference=True)
        metrics = self.rollouts.evaluate(step, reference=True)
        if self.offload:
            self.rollouts.release_memory(reference=True)
        return metrics

    def write_pids(self) -> None:
        """logging.dir/pids.json: the process ids of the engine servers and the trainer ranks (operators, and
        the fault tests)."""
        path = Path(self.cfg.logging.dir) / "pids.json"
        path.write_text(json.dumps({"engines": self.rollouts.pids(), "trainers": self.trainers.pids()}))

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save(self, step: int, wait: bool = False) -> Path | None:
        """Every rank writes its own files, the driver its RNG state; then the checkpoint is published, at once
        (returns its path) or, with checkpoint.async_save and not `wait`, by `publish` once the trainer's
        files are written (returns None). One save is in flight at a time. A step saved already is not written
        again (a stop right after a step's checkpoint: the grace time before a kill is short)."""
        root = self.cfg.checkpoint.dir
        if step == self.saved_step:
            return (self.publish() or ckpt.step_dir(root, step)) if wait else None
        self.publish()
        try:
            ckpt.check_space(root)
        except OSError as err:
            raise RunFailure(f"checkpoint of step {step} not written: {err.strerror}") from None
        self.saved_step = step
        files = [record for rank in self.trainers.save_checkpoint(root, step) for record in rank]
        files.append(ckpt.write_file(root, step, DRIVER_FILE, {"rng": ckpt.rng_state()}))
        meta = {"format": self.cfg.checkpoint.format, "world_size": len(self.trainers), "config": to_dict(self.cfg),
                "engine_restarts": self.engine_restarts}
        self.in_flight = (step, files, meta)
        return self.publish() if wait or not self.cfg.checkpoint.async_save else None

    def publish(self) -> Path | None:
        """Publish the checkpoint in flight once every trainer rank's files are written (announced on the
        console); its path, or None when none is in flight."""
        if self.in_flight is None:
            return None
        step, files, meta = self.in_flight
        self.in_flight = None
        files = files + [record for rank in self.trainers.finish_checkpoint() for record in rank]
        path = ckpt.finalize(self.cfg.checkpoint.dir, step, files, meta, keep=self.cfg.checkpoint.keep)
        say(f"checkpoint {path}")
        return path

    def restore(self, path: Path | None) -> int:
        """Load checkpoint `path` (verified), if any; returns the step to continue from."""
        if path is None:
            return 0
        meta = ckpt.read_meta(path)
        if not ckpt.FORMATS[ckpt.format_of(meta)] and meta["world_size"] != len(self.trainers):
            raise ConfigError(f"{path} was written by {meta['world_size']} trainer ranks, this run has "
                              f"{len(self.trainers)}; resume with the same train.tp_size/dp_size")
        self.trainers.load_checkpoint(str(path))
        ckpt.set_rng_state(ckpt.read_file(path, DRIVER_FILE)["rng"])
        self.engine_restarts = meta.get("engine_restarts", 0)
        return meta["step"]

    # -- one step -------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        samples, metrics = self.rollout(step)
        self.publish()  # checkpoint.async_save: the last step's files were written during this rollout
        if self.offload:  # the trainer steps in the engines' memory; push_all gives it back
            self.recovering(self.rollouts.release_memory, f"step-{step}")
        samples, adv, adv_metrics = advantages(self.cfg, samples)
        metrics.update(adv_metrics)
        t_train = time.perf_counter()
        if samples:
            batch = collate(samples, adv, pad_id=0)
            metrics.update(self.trainers.step(batch))
        else:
            metrics["train/skipped_nonfinite"] = 0.0
        t_push = time.perf_counter()
        metrics.update(self.push_all(f"step-{step + 1}"))
        end = time.perf_counter()
        metrics.update({"time/train_step": t_push - t_train, "time/step": end - start,
                        "train/skipped_no_signal": float(not samples),  # dynamic sampling dropped every group
                        "rollout/engine_restarts": float(self.engine_restarts)})
        return metrics

    def close(self, timeout: float | None = None) -> None:
        """The engines, then the trainer ranks, each group given `timeout` seconds in all to stop (default:
        its own bound), then killed."""
        try:
            self.rollouts.close(timeout)
        finally:
            try:
                self.trainers.close(timeout)
            finally:
                remove_placement_group(self.pg)


def say(message: str) -> None:
    """One line on the console for a notable event, above the progress bar."""
    tqdm.write(f"qurl train: {message}", file=sys.stderr)


def _evaluated(loop: Loop, step: int) -> dict[str, float]:
    """`loop.evaluate(step)`, announced on the console."""
    metrics = loop.evaluate(step)
    bf16 = metrics.get("eval/accuracy_bf16")
    say(f"step {step} held-out accuracy {metrics['eval/accuracy']:.3f}" +
        ("" if bf16 is None else f" (BF16 engine {bf16:.3f})"))
    return metrics


def _progress(cfg: Config, start: int):
    return tqdm(total=cfg.steps, initial=start, desc="qurl train", unit="step", disable=not cfg.logging.progress,
                file=sys.stderr, dynamic_ncols=True)


#: what a checkpoint is tied to: the model its weights are, the precision they trained under, and (a
#: checkpoint.format whose files only their own layout loads: `checkpoint.FORMATS`) how its rank files slice them
RESUME_FIELDS = ("model.path", "precision", "scope", "fp4_format", "train.dtype")
LAYOUT_FIELDS = ("train.tp_size", "train.pp_size", "train.ep_size", "train.dp_size")


def resume_mismatch(saved: dict, cfg: Config) -> list[str]:
    """The RESUME_FIELDS (and LAYOUT_FIELDS, for a format another layout cannot load) whose value in a
    checkpoint's config (`saved`, meta.json's) differs from `cfg`'s, each as "key: checkpoint's value
    (checkpoint) vs cfg's (this run)"; a field the checkpoint does not record is not compared."""
    before, now = flatten(saved), flatten(to_dict(cfg))
    reshardable = ckpt.FORMATS[before.get("checkpoint.format", ckpt.format_of({}))]
    fields = RESUME_FIELDS + (() if reshardable else LAYOUT_FIELDS)
    return [f"{key}: {before[key]!r} (checkpoint) vs {now[key]!r} (this run)" for key in fields
            if key in before and before[key] != now[key]]


def check_resumable(cfg: Config, path: Path | None) -> None:
    """Raise ConfigError naming every `resume_mismatch` of checkpoint `path` (None: nothing to resume), unless
    `checkpoint.allow_mismatch`."""
    differ = resume_mismatch(ckpt.read_meta(path)["config"], cfg) if path else []
    if differ and not cfg.checkpoint.allow_mismatch:
        raise ConfigError(f"{path} was written by another run: {'; '.join(differ)}; give this run its own "
                          "checkpoint.dir, or set checkpoint.allow_mismatch=true to continue that checkpoint with "
                          "this run's settings")


def run(cfg: Config, address: str | None = None) -> RunResult:
    """Train for `cfg.steps` steps (resuming from `cfg.checkpoint.dir` when it holds a checkpoint). `address`
    joins an existing Ray cluster (default: $RAY_ADDRESS, else a local one). Raises ConfigError listing
    every problem `qurl_mcore.preflight` finds, before anything starts.

    The console gets the progress bar and one line per notable event; everything the actors print (and the
    driver's Python warnings) goes to files in `logging.dir` (driver.log, trainer-<rank>.log, engine-<i>.log,
    rollout-manager.log)."""
    address = address or os.environ.get("RAY_ADDRESS")  # an existing cluster brings its own node tags
    checked = preflight(cfg, local=not address)
    if not checked.ok:
        raise ConfigError(checked.report())
    locks = lock_dirs(cfg.checkpoint.dir, cfg.logging.dir)  # one run per directory, to the run's end
    resume_from, damaged = ckpt.latest_valid(cfg.checkpoint.dir)  # before anything starts: it reads every file
    try:
        check_resumable(cfg, resume_from)
    except ConfigError:
        locks.release()
        raise
    for path, problem in damaged:
        say(f"checkpoint {path} is damaged ({problem}); " +
            (f"resuming from {resume_from} instead" if resume_from else "starting from scratch"))
    logs = Path(cfg.logging.dir)
    warnings_to_file(logs / "driver.log")
    precision, scope, _ = cfg.resolved_precision()
    code = code_version()  # named in the run's first line and its W&B config: which code made these metrics
    say(f"{cfg.steps} steps of {cfg.model.path}, precision {precision.name} (scope {scope}), {cfg.layout}, "
        f"{cfg.train.world_size} trainer rank(s), {cfg.rollout.engines} engine(s); code {code.label()}; "
        f"logs in {logs}")
    owns_ray = not ray.is_initialized()
    reaper = start_reaper() if owns_ray else None  # Ray's processes, also after a kill -9 of this one
    before_ray = set(descendants())  # what this process ran before Ray: not the run's to stop at its end
    if owns_ray:
        # "local": never attach to a cluster some earlier `ray start` left behind on this machine
        try:
            with shielded_children():  # a SIGTERM to the whole group leaves Ray to the checkpoint that follows it
                ray.init(address=address or "local",
                         resources=None if address else {"qurl_train": 1, "qurl_rollout": 1},
                         log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
        except BaseException as err:  # Ctrl-C included: the directories are the next run's
            locks.release()
            if reaper is not None:
                reaper.kill()
                reaper.wait()
            if isinstance(err, Exception):  # a start-up timeout, an address nobody answers at: one line
                reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise RunFailure(f"Ray did not start{f' at {address}' if address else ''}: {reason}") from None
            raise
    stop = StopRequest(grace_s=cfg.checkpoint.stop_grace_s)  # after ray.init, whose own SIGTERM handler would abort
    log: MetricsLog | None = None
    loop: Loop | None = None
    step = 0
    try:
        torch.manual_seed(cfg.seed)
        log = MetricsLog(logs, wandb_project=cfg.logging.wandb_project,
                         run_config={**to_dict(cfg), "code": asdict(code)})
        loop = Loop(cfg, stop)
        loop.write_pids()
        step = loop.restore(resume_from)
        if step:
            say(f"resuming at step {step} from {cfg.checkpoint.dir}")
        log.truncate(step if step else -1)  # records after the checkpoint are redone (from scratch: step 0 too)
        loop.check_symmetry()
        loop.push_all(f"step-{step}")  # UAQ-scaled or resumed weights replace the checkpoint the engines loaded
        if cfg.eval.every and step == 0:  # the baseline: the held-out accuracy before any update
            log.log(0, _evaluated(loop, 0))
        bar = _progress(cfg, step)
        while step < cfg.steps and not stop.requested:
            metrics = loop.step(step)
            step += 1
            if stop.requested:  # the step ended within the grace: its checkpoint is written, however long
                stop.steps_ended()
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
                metrics.update(_evaluated(loop, step))
            log.log(step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            tok_s=f"{metrics['perf/rollout_tokens_per_s']:.0f}", refresh=False)
            if metrics.get("train/skipped_nonfinite"):
                say(f"step {step} skipped: non-finite loss or gradient (grad norm {metrics['train/grad_norm']})")
            if metrics.get("train/skipped_no_signal"):
                say(f"step {step} skipped: every prompt group had equal rewards (no learning signal)")
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                loop.save(step)
        stop.steps_ended()  # what follows (the last checkpoint, the export) is no step
        loop.publish()
        bar.close()
        if step == cfg.steps and cfg.checkpoint.export_hf:
            say(f"exported the trained model to {loop.trainers.export_hf(str(Path(cfg.checkpoint.dir) / 'hf'))}")
        if stop.requested and step < cfg.steps:
            path = loop.save(step, wait=True)
            say(f"{stop.signal_name} at step {step}: checkpoint written to {path}, exiting")
    except StopOverdue as overdue:  # the actors are mid-step: they are killed, the last checkpoint stays
        say(f"{overdue}; resume takes the last checkpoint ({ckpt.latest_checkpoint(cfg.checkpoint.dir) or 'none'})")
        if loop is not None:
            loop.close(timeout=0.0)
            loop = None
    finally:
        try:
            if log is not None:
                log.close()
            if loop is not None:
                loop.close()
        finally:  # whatever failed above, Ray, the signals and the directories are given back
            if owns_ray:
                spawned = [pid for pid in descendants() if pid not in before_ray]
                ray.shutdown()
                left = stop_survivors(spawned, RAY_EXIT_GRACE_S)
                if left:
                    say(f"stopped {len(left)} process(es) the run started that outlived Ray: {', '.join(left)}")
                if reaper is not None:  # nothing of the run is left for it
                    reaper.kill()
                    reaper.wait()
            stop.restore()
            locks.release()
    report = write_report(log.path, cfg.logging.dir) if log.path.exists() else None
    return RunResult(step, stop.requested, Path(cfg.logging.dir), report)
