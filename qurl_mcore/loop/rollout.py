"""The rollout side of the loop: which prompts a step takes, the SGLang engines that answer them, the rewards.

`EngineHost` runs on the node (and devices) of one SGLang HTTP server and owns it: it starts and restarts it,
and pushes weights to it from the same host (tensor pushes share memory with the server). `RolloutManager`
owns the prompt set, the reward function and the hosts: it turns a step number into scored `Sample`s.
Both are plain classes; `actors.py` runs them as Ray actors.
"""
from __future__ import annotations

import random
import time
from typing import Any

from qurl_mcore.config import Config
from qurl_mcore.rollout import EngineConfig, Generation, HttpEngine
from qurl_mcore.tasks import REWARDS, Example, addition_examples, load_examples, score_all

from .batch import Sample


def engine_quantization(cfg: Config) -> tuple[str | None, dict[str, Any]]:
    """The SGLang quantization method and options of the configured rollout precision."""
    r = cfg.rollout
    if r.precision == "bf16":
        return None, {}
    if r.precision in ("int8", "fp8"):
        return f"qurl_{r.precision}", {"scope": r.scope}
    return f"qurl_{r.precision}", {"fmt": r.fp4_format, "scope": r.scope}


def engine_config(cfg: Config, model_path: str, device: str) -> EngineConfig:
    method, options = engine_quantization(cfg)
    extra: dict[str, Any] = {"tp_size": cfg.rollout.tp_size} if cfg.rollout.tp_size > 1 else {}
    return EngineConfig(str(model_path), method, options, device=device, dtype=cfg.rollout.dtype, random_seed=cfg.seed,
                        context_length=cfg.rollout.context_length,
                        max_total_tokens=cfg.rollout.max_total_tokens or None, extra=extra)


class EngineFailure(RuntimeError):
    """An engine stopped answering (crashed, killed, unreachable); `index` says which."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"rollout engine {index} failed: {reason}")
        self.index, self.reason = index, reason

    def __reduce__(self):  # crosses process boundaries inside Ray errors
        return EngineFailure, (self.index, self.reason)


class EngineHost:
    """One SGLang server on this node: start, generate, push weights, restart."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0):
        self.config = config
        self.startup_timeout = startup_timeout
        self.engine: HttpEngine | None = None
        self.start()

    def start(self) -> str:
        self.engine = HttpEngine.launch(self.config, startup_timeout=self.startup_timeout)
        return self.engine.url

    def pid(self) -> int:
        return self.engine.process.pid

    def restart(self) -> str:
        """Stop what is left of the server and start a fresh one; it serves the checkpoint's weights until
        the next push."""
        self.shutdown()
        return self.start()

    def generate(self, input_ids: list[list[int]], sampling: dict) -> list[Generation]:
        return self.engine.generate(input_ids, sampling)

    def push(self, named_buckets: list[list[tuple[str, Any]]], version: str, bucket_bytes: int) -> int:
        return self.engine.push_weights((nt for bucket in named_buckets for nt in bucket), version,
                                        bucket_bytes=bucket_bytes)

    # broadcast pushes (disaggregated layout): the engine's TP ranks follow the trainer's rank 0 in a group
    def join_weight_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str) -> None:
        self.engine.join_weight_group(master_addr, master_port, rank_offset, world_size, group_name, backend)

    def check_specs(self, specs: list) -> None:
        self.engine.check_specs(specs)

    def receive(self, specs: list, version: str, group_name: str) -> int:
        return self.engine.receive_weights(specs, version, group_name)

    def leave_weight_group(self, group_name: str) -> None:
        self.engine.leave_weight_group(group_name)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def prompt_indices(num_examples: int, step: int, per_step: int, seed: int) -> list[int]:
    """The prompts of `step`: positions step·P .. step·P + P − 1 of an endless stream of epochs, epoch e a
    permutation of the prompt set seeded by (seed, e). A pure function of the step, so a resumed run takes
    exactly the prompts the uninterrupted run would have."""
    out = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        order = list(range(num_examples))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        out.append(order[offset])
    return out


def load_prompt_set(cfg: Config) -> list[Example]:
    d = cfg.data
    if d.task == "addition":
        return addition_examples(d.num_prompts, seed=cfg.seed, max_operand=d.max_operand)
    return load_examples(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key)


class RolloutManager:
    """Prompts → n samples each from the engines (behaviour log-probs included) → rewards."""

    def __init__(self, cfg: Config, model_path: str, hosts: list):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.hosts = hosts
        self.examples = load_prompt_set(cfg)
        self.reward_fn = REWARDS[cfg.data.reward]
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._ids: dict[int, list[int]] = {}

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._ids:
            messages = [dict(m) for m in self.examples[index].messages]
            if self.cfg.data.system_prompt:
                messages.insert(0, {"role": "system", "content": self.cfg.data.system_prompt})
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self._ids[index] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._ids[index]

    def sampling(self) -> dict:
        r = self.cfg.rollout
        return {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k}

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Samples of `step`, group after group (n per prompt), with rewards. Raises EngineFailure naming the
        first engine that failed."""
        n = self.cfg.rollout.samples_per_prompt
        chosen = prompt_indices(len(self.examples), step, self.cfg.data.prompts_per_step, self.cfg.seed)
        start = time.perf_counter()
        # whole groups per engine, round robin over positions (a step across an epoch boundary may repeat a prompt)
        shares: list[list[int]] = [list(range(i, len(chosen), len(self.hosts))) for i in range(len(self.hosts))]
        results = self._gather({i: host.generate.remote([self.prompt_ids(chosen[p]) for p in share for _ in range(n)],
                                                        self.sampling())
                                for i, (host, share) in enumerate(zip(self.hosts, shares))})
        elapsed = time.perf_counter() - start
        by_position = {p: gens[k * n:(k + 1) * n] for gens, share in zip(results, shares)
                       for k, p in enumerate(share)}
        gens = [g for p in range(len(chosen)) for g in by_position[p]]
        answers = [self.examples[j].answer for j in chosen for _ in range(n)]
        rewards, stats = score_all(self.reward_fn, [g.text for g in gens], answers)
        samples = [Sample(g.prompt_ids, g.output_ids, g.output_logprobs, reward, group=k // n,
                          meta={"prompt": j, "text": g.text})
                   for k, (g, reward, j) in enumerate(zip(gens, rewards, (j for j in chosen for _ in range(n))))]
        lengths = [len(g.output_ids) for g in gens]
        truncated = sum(len(g.output_ids) >= self.cfg.rollout.max_new_tokens for g in gens)
        metrics = {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/errors": float(stats.errors),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/truncated_frac": truncated / len(gens),
            "time/rollout": elapsed,
            "perf/rollout_tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
        }
        return samples, metrics

    def push(self, buckets_ref: list, version: str, only: list[int] | None = None) -> float:
        """Every engine (or those in `only`) loads the weights as `version` and re-quantizes them; returns the
        seconds taken. `buckets_ref` is [ObjectRef of the trainer's buckets]: wrapped, so that Ray hands the
        reference on to the hosts instead of copying the weights through this actor."""
        start = time.perf_counter()
        bucket_bytes = self.cfg.rollout.push_bucket_mb << 20
        chosen = range(len(self.hosts)) if only is None else only
        self._gather({i: self.hosts[i].push.remote(buckets_ref[0], version, bucket_bytes) for i in chosen})
        return time.perf_counter() - start

    def open_group(self, sender, master_addr: str, master_port: int, group_name: str, backend: str,
                   timeout: float) -> None:
        """One weight group: the trainer's rank 0 (`sender`, an actor handle) as rank 0, then every engine's
        TP ranks in engine order. Joins all at once (each blocks until the group is complete)."""
        import ray

        tp = self.cfg.rollout.tp_size
        world = 1 + tp * len(self.hosts)
        joins = {i: host.join_weight_group.remote(master_addr, master_port, 1 + i * tp, world, group_name, backend)
                 for i, host in enumerate(self.hosts)}
        created = sender.open_weight_group.remote(master_addr, master_port, world, group_name, backend, timeout)
        self._gather(joins)
        ray.get(created)

    def leave_group(self, group_name: str) -> None:
        """Every engine leaves the group (best effort: a restarted engine was never in it)."""
        import ray

        for host in self.hosts:
            try:
                ray.get(host.leave_weight_group.remote(group_name))
            except Exception:  # noqa: BLE001 - the group is being replaced anyway
                pass

    def broadcast(self, sender, specs: list, version: str, group_name: str) -> float:
        """A broadcast push of the buckets `sender` (the trainer's rank 0) has staged, described by `specs`:
        every engine validates the specs first (a bad spec stops the push before anything moves), then
        receives while the sender broadcasts. Returns the seconds taken."""
        import ray

        start = time.perf_counter()
        ray.get([host.check_specs.remote(specs) for host in self.hosts])
        sent = sender.send_weights.remote()
        self._gather({i: host.receive.remote(specs, version, group_name) for i, host in enumerate(self.hosts)})
        ray.get(sent)
        return time.perf_counter() - start

    def _gather(self, futures: dict[int, Any]) -> list:
        """Results of the hosts' calls, in order; EngineFailure names the first engine that failed."""
        import ray

        out = []
        for index, future in futures.items():
            try:
                out.append(ray.get(future))
            except Exception as err:  # noqa: BLE001 - any transport/engine error means this engine must restart
                raise EngineFailure(index, f"{type(err).__name__}: {err}"[:2000]) from None
        return out

    def restart(self, index: int) -> None:
        import ray

        ray.get(self.hosts[index].restart.remote())

    def pids(self) -> list[int]:
        import ray

        return ray.get([host.pid.remote() for host in self.hosts])
