"""The rollout side of the loop: which prompts a step takes, the SGLang engines that answer them, the rewards.

`EngineHost` runs on the node (and devices) of one SGLang HTTP server and owns it: it starts and restarts it.
The trainer pushes weights to the servers itself (trainer.py). `RolloutManager` owns the prompt set, the
reward function and the hosts: it turns a step number into scored `Sample`s.
Both are plain classes; `actors.py` runs them as Ray actors.
"""
from __future__ import annotations

import functools
import json
import os
import random
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from qurl_mcore.config import Config
from qurl_mcore.heldout import eval_examples
from qurl_mcore.recipe import EngineRecipe
from qurl_mcore.rollout import MEMORY_TAGS, EngineConfig, Generation, HttpEngine
from qurl_mcore.models.registry import shape
from qurl_mcore.rollout.engine import moe_shape
from qurl_mcore.rollout.results import NonFiniteLogprobs, RequestRefused
from qurl_mcore.sglang.options import QUANTIZED_LOG_ENV
from qurl_mcore.tasks import Example, addition_examples, chat_ids, load_examples, load_reward, score_all
from qurl_mcore.transfer import bind_gloo_towards

from .batch import Sample
from .evaluation import BF16_SUFFIX, samples, sampling, score
from .outcome import error_line
from .tracking import redirect_output


def _ray():
    """Ray, imported on first use: the trainer imports this module's configs on machines without Ray."""
    import ray

    return ray


def engine_quantization(engine: EngineRecipe | None, requant: str,
                        push: str = "bf16") -> tuple[str | None, dict[str, Any]]:
    """The SGLang method and options of a recipe's engine half (`qurl_mcore.recipe.Recipe.engine`; None: a
    full-precision engine); `requant` is how engines re-quantize pushed weights (`rollout.requant`), `push` what
    pushes carry (`Config.push_mode`)."""
    if engine is None:
        return None, {}
    return engine.method, {"fmt": engine.fmt, "scope": engine.scope, "requant": requant, "push": push}


def new_api_key() -> str:
    """A fresh engine key: 256 random bits in hex (a URL-safe key may begin with '-', which SGLang's argument
    parser takes for an option)."""
    return secrets.token_hex(32)


def engine_config(cfg: Config, engine: EngineRecipe | None, model_path: str, device: str) -> EngineConfig:
    """The engine of a run computing `engine` (the run's `Recipe.engine`); an MoE's engine returns each token's
    routed experts (routing metrics, replay)."""
    r = cfg.rollout
    push = cfg.push_mode(shape(model_path))
    method, options = engine_quantization(engine, r.requant, push)
    extra: dict[str, Any] = {"tp_size": cfg.rollout.tp_size} if cfg.rollout.tp_size > 1 else {}
    if device == "cuda" and cfg.offload_rollout(cuda=True):  # torch_memory_saver's allocator (GPUs only)
        extra["enable_memory_saver"] = True
    return EngineConfig(str(model_path), method, options, device=device, dtype=cfg.rollout.dtype, random_seed=cfg.seed,
                        context_length=cfg.rollout.context_length, mem_fraction_static=cfg.rollout.mem_fraction or None,
                        max_total_tokens=cfg.rollout.max_total_tokens or None,
                        return_routed_experts=moe_shape(model_path) is not None, extra=extra)


def reference_engine_config(cfg: Config, model_path: str, device: str) -> EngineConfig:
    """The BF16 reference engine of `eval.bf16_reference`: the rollout engines' settings without quantization."""
    return engine_config(cfg, None, model_path, device)


class EngineFailure(RuntimeError):
    """An engine stopped answering (crashed, killed, unreachable); `index` says which."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"rollout engine {index} failed: {reason}")
        self.index, self.reason = index, reason

    def __reduce__(self):  # crosses process boundaries inside Ray errors
        return EngineFailure, (self.index, self.reason)


class EngineHost:
    """One SGLang HTTP server on this node: start, generate, restart. It listens on `host` (loopback, unless
    None: this node's address, for an engine other nodes push to) and logs which linears it quantized, for
    the loop's check that trainer and engines quantize the same ones."""

    def __init__(self, config: EngineConfig, host: str | None = "127.0.0.1", startup_timeout: float = 600.0,
                 log_file: str | None = None):
        if log_file:  # the host's output and its server's go to the run's logs
            redirect_output(log_file)
        self.log_file = log_file
        self.config = config
        self.host = host or _ray().util.get_node_ip_address()
        bind_gloo_towards(self.host)  # its server's broadcast group with the trainer (inherited by SGLang)
        self.startup_timeout = startup_timeout
        self.engine: HttpEngine | None = None
        self.quantized_log = ""
        self.start()

    def start(self) -> tuple[str, str | None]:
        self.released: set[str] = set()  # memory tags given back (release_memory) and not yet resumed
        fd, self.quantized_log = tempfile.mkstemp(prefix="qurl-quantized-", suffix=".txt")
        os.close(fd)
        # a fresh key per server: only the trainer ranks that push to it learn it (endpoint(), through Ray)
        self.engine = HttpEngine.launch(self.config, host=self.host, startup_timeout=self.startup_timeout,
                                        api_key=new_api_key(), env={QUANTIZED_LOG_ENV: self.quantized_log},
                                        log_path=self.log_file)
        return self.endpoint()

    def endpoint(self) -> tuple[str, str | None]:
        """(URL, API key) of the server, for the clients that push weights to it."""
        return self.engine.url, self.engine.api_key

    def pid(self) -> int:
        return self.engine.process.pid

    def quantized_linears(self) -> set[str]:
        """HF module names of the linears the engine's processes quantized."""
        return set(Path(self.quantized_log).read_text().split())

    def restart(self) -> tuple[str, str | None]:
        """Stop what is left of the server and start a fresh one; it serves the checkpoint's weights until
        the next push. Returns the new endpoint."""
        self.shutdown()
        return self.start()

    def generate(self, input_ids: list[list[int]], sampling: dict) -> list[Generation]:
        return self.engine.generate(input_ids, sampling, routed_experts=self.config.return_routed_experts)

    def release_memory(self) -> None:
        """Give back all of the engine's GPU memory (the trainer on the same GPU steps meanwhile)."""
        self.engine.release_memory(MEMORY_TAGS)
        self.released = set(MEMORY_TAGS)

    def resume_memory(self, tags: list[str]) -> None:
        """Take back those of `tags` that are released (none on a freshly restarted engine)."""
        todo = [t for t in MEMORY_TAGS if t in tags and t in self.released]
        if todo:
            self.engine.resume_memory(todo)
            self.released -= set(todo)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.quantized_log:
            Path(self.quantized_log).unlink(missing_ok=True)
            self.quantized_log = ""


def prompt_indices(num_examples: int, step: int, per_step: int, seed: int) -> list[int]:
    """The prompts of `step`: positions step·P .. step·P + P − 1 of an endless stream of epochs, epoch e a
    permutation of the prompt set seeded by (seed, e). A pure function of the step, so a resumed run takes
    exactly the prompts the uninterrupted run would have. Each epoch's permutation is made once and kept
    while the steps go through it (`epoch_order`)."""
    out = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        out.append(epoch_order(num_examples, seed, epoch)[offset])
    return out


@functools.lru_cache(maxsize=2)  # the epoch a step is in, and the one before while a step spans both
def epoch_order(num_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """Epoch `epoch`'s permutation of 0 .. num_examples − 1, seeded by (seed, epoch)."""
    order = list(range(num_examples))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return tuple(order)


def load_prompt_set(cfg: Config) -> list[Example]:
    d = cfg.data
    if d.task == "addition":
        return addition_examples(d.num_prompts, seed=cfg.seed, min_operand=d.min_operand, max_operand=d.max_operand)
    return load_examples(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key)


class RolloutManager:
    """Prompts → n samples each from the engines (behaviour log-probs included) → rewards; and the held-out
    evaluation (evaluation.py) on the same engines or on the BF16 `reference` engine's host, engine number
    `len(hosts)` (eval.bf16_reference)."""

    def __init__(self, cfg: Config, model_path: str, hosts: list, log_file: str | None = None, reference=None):
        if log_file:
            redirect_output(log_file)
        from transformers import AutoTokenizer  # only the manager's own process needs it, not the driver's


        self.cfg = cfg
        self.hosts = hosts
        self.reference = reference
        self.examples = load_prompt_set(cfg)
        self.reward_fn = load_reward(cfg.data.reward)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._ids: dict[int, list[int]] = {}
        self.eval_examples = eval_examples(cfg, self.examples) if cfg.eval.every else []
        self.eval_ids = [chat_ids(self.tokenizer, ex, cfg.data.system_prompt) for ex in self.eval_examples]

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._ids:
            self._ids[index] = chat_ids(self.tokenizer, self.examples[index], self.cfg.data.system_prompt)
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
                          routed_experts=g.routed_experts, meta={"prompt": j, "text": g.text})
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

    def evaluate(self, step: int, *, reference: bool = False) -> dict[str, float]:
        """The eval/* metrics (evaluation.py) of the held-out prompts, `eval.n` samples each: on the rollout
        engines (requests split evenly over them), or with `reference` on the BF16 reference engine (names
        suffixed `_bf16`). Every sample goes to logging.dir/eval/step_<step>[_bf16].jsonl. Raises
        EngineFailure naming the first engine that failed."""
        n = self.cfg.eval.n
        ids = [i for i in self.eval_ids for _ in range(n)]
        hosts = self._hosts(reference)
        size = -(-len(ids) // len(hosts))
        parts = self._gather({i: host.generate.remote(ids[k * size:(k + 1) * size], sampling(self.cfg))
                              for k, (i, host) in enumerate(hosts) if ids[k * size:(k + 1) * size]})
        gens = [g for part in parts for g in part]
        suffix = BF16_SUFFIX if reference else ""
        metrics, rewards = score(self.reward_fn, gens, [ex.answer for ex in self.eval_examples for _ in range(n)], n,
                                 self.cfg.rollout.max_new_tokens, suffix)
        path = Path(self.cfg.logging.dir) / "eval" / f"step_{step:08d}{suffix}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in samples(self.eval_examples, n, gens, rewards)))
        return metrics

    def reference_endpoint(self) -> tuple[str, str | None]:
        """(URL, API key) of the BF16 reference engine, for trainer rank 0 to push to."""
        return _ray().get(self.reference.endpoint.remote())

    def _hosts(self, reference: bool) -> list[tuple[int, Any]]:
        """(engine number, host) of the rollout engines, or of the reference engine alone."""
        return [(len(self.hosts), self.reference)] if reference else list(enumerate(self.hosts))

    def endpoints(self) -> list[tuple[str, str | None]]:
        """Every engine's (URL, API key), in engine order."""
        return _ray().get([host.endpoint.remote() for host in self.hosts])

    def quantized_linears(self) -> list[set[str]]:
        return _ray().get([host.quantized_linears.remote() for host in self.hosts])

    def _gather(self, futures: dict[int, Any]) -> list:
        """Results of the hosts' calls, in order; EngineFailure names the first engine that failed."""
        out = []
        for index, future in futures.items():
            try:
                out.append(_ray().get(future))
            except Exception as err:  # noqa: BLE001 - any transport/engine error means this engine must restart
                # a request's own error, or the weights': no restart fixes it
                if isinstance(getattr(err, "cause", err), (RequestRefused, NonFiniteLogprobs)):
                    raise getattr(err, "cause", err) from None
                raise EngineFailure(index, error_line(err)) from None
        return out

    def restart(self, index: int) -> None:
        """Restart engine `index` (`len(hosts)`: the reference engine)."""
        _ray().get((self.hosts[index] if index < len(self.hosts) else self.reference).restart.remote())

    def release_memory(self, *, reference: bool = False) -> None:
        """Every engine (or the reference engine) gives back its GPU memory (EngineFailure names one that fails)."""
        self._gather({i: host.release_memory.remote() for i, host in self._hosts(reference)})

    def resume_memory(self, tags: list[str], *, reference: bool = False) -> None:
        """Every engine (or the reference engine) takes back the memory of those `tags` it released
        (EngineFailure names one that fails)."""
        self._gather({i: host.resume_memory.remote(tags) for i, host in self._hosts(reference)})

    def pids(self) -> list[int]:
        return _ray().get([host.pid.remote() for host in self.hosts])
