"""Typed handles on the loop's Ray actors: the driver calls named methods, these make the remote calls.

`TrainerGroup`  the trainer ranks (`trainer.PolicyTrainer`), called all together: most calls are collectives.
`Rollouts`      the rollout manager (`rollout.RolloutManager`) and the engine hosts (`rollout.EngineHost`).

Each method forwards to the actor method of its name (`TrainerGroup.pids` to `PolicyTrainer.pid`), with the
same arguments, flags as keywords. Failures come back in two kinds: an engine's, as the `EngineFailure` the
actor raised (the driver restarts that engine: `Rollouts.restart`), and any other, which ends the run as a
`RunFailure` naming the actor, the method and the actor's log file in `logging.dir`.
"""
from __future__ import annotations

import time
from typing import Any, Callable
from urllib.parse import urlsplit

import ray

from .batch import Sample, TrainBatch
from .outcome import RunFailure, StopOverdue, StopRequest, error_line
from .sampler import EngineFailure

def _first_ready(pending: list, deadline: float | None, stop: StopRequest | None) -> tuple[list, list]:
    """`ray.wait` for the first of `pending` until `deadline` (time.monotonic(); None: no deadline), waking
    every second to raise StopOverdue once `stop`'s grace has passed."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return [], pending
        ready, rest = ray.wait(pending, num_returns=1, timeout=1.0 if left is None else min(left, 1.0))
        if ready:
            return ready, rest
        if stop is not None and stop.overdue():
            raise StopOverdue(f"{stop.signal_name} {stop.grace_s:g} s ago and the step in progress has not ended "
                              "(checkpoint.stop_grace_s): exiting without it")


def _close(actors: list, stop: Callable[[Any], Any], timeout: float) -> None:
    """`stop(actor)` (a remote call) on every one of `actors` at once, waited for `timeout` seconds in all, then
    kill them all. Best effort: a failed actor has nothing left to stop, and is killed either way."""
    refs = []
    for actor in actors:
        try:
            refs.append(stop(actor))
        except Exception:  # noqa: BLE001 - killed below either way
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for actor in actors:
        ray.kill(actor)


class TrainerGroup:
    """The trainer ranks, in rank order; rank r writes `logs`/trainer-<r>.log. Once one rank has answered a
    call, the others have `hang_timeout` seconds (train.hang_timeout_s), also to close."""

    def __init__(self, actors: list, logs: str, hang_timeout: float, stop: StopRequest | None = None):
        self.actors = actors
        self.logs = logs
        self.hang_timeout = hang_timeout
        self.stop = stop  # its grace bounds every wait once a stop is requested

    def __len__(self) -> int:
        return len(self.actors)

    def _on_every_rank(self, method: str, call: Callable[[Any], Any], lag_bound: bool = True) -> list:
        """`call(rank's actor)`, the remote call of `method`, on every rank at once; their results in rank
        order. The first failure ends the wait: an EngineFailure a rank reports passes through (that engine
        restarts); any other error is the rank's own and ends the run (RunFailure naming it), as does a rank
        that has not answered `hang_timeout` seconds after the first one did (unless not `lag_bound`: a call
        whose ranks do unequal work)."""
        refs = {call(actor): rank for rank, actor in enumerate(self.actors)}
        results, pending = {}, list(refs)
        deadline = None  # set by the first answer
        while pending:
            ready, pending = _first_ready(pending, deadline, self.stop)
            if not ready:
                rank = min(refs[ref] for ref in pending)
                raise RunFailure(f"trainer rank {rank} hung in {method}: no answer {self.hang_timeout:g} s after "
                                 f"rank(s) {', '.join(map(str, sorted(results)))} answered (train.hang_timeout_s); "
                                 f"see {self.logs}/trainer-{rank}.log")
            deadline = deadline or (time.monotonic() + self.hang_timeout if lag_bound else None)
            rank = refs[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - every Ray error of a rank, classified below
                if isinstance(getattr(err, "cause", None), EngineFailure):
                    raise err.cause from None
                raise RunFailure(f"trainer rank {rank} failed in {method}: {error_line(err)}; see "
                                 f"{self.logs}/trainer-{rank}.log") from None
        return [results[rank] for rank in sorted(results)]

    def connect_engines(self, endpoints: list[tuple[str, str | None]]) -> None:
        """Every rank attaches to the engines it pushes to, given every engine's (URL, API key)."""
        self._on_every_rank("connect_engines", lambda t: t.connect_engines.remote(endpoints))

    def open_weight_group(self, group_name: str, *, backend: str, timeout: float) -> str:
        """Disaggregated layout: rank 0 opens weight group `group_name` with every engine's TP ranks; returns
        its rendezvous address."""
        return self._on_every_rank("open_weight_group", lambda t: t.open_weight_group.remote(
            group_name, backend=backend, timeout=timeout))[0]

    def close_weight_group(self) -> None:
        self._on_every_rank("close_weight_group", lambda t: t.close_weight_group.remote())

    def quantized_linears(self) -> set[str]:
        """HF module names of the linears any rank quantizes."""
        return set().union(*self._on_every_rank("quantized_linears", lambda t: t.quantized_linears.remote()))

    def push_weights(self, version: str, *, only: list[int] | None = None) -> dict[str, float]:
        """Every rank streams its weights to its engines (of `only` those engines, if given) as weight
        `version`; returns the push's metrics (`PolicyTrainer.push_weights`): the seconds the slowest rank took,
        the bytes and the verified units of all ranks together."""
        ranks = self._on_every_rank("push_weights", lambda t: t.push_weights.remote(version, only=only))
        return {key: (max if key == "time/push" else sum)(r[key] for r in ranks) for key in ranks[0]}

    def push_reference(self, endpoint: tuple[str, str | None], version: str) -> float:
        """The weights, as weight `version`, to the BF16 reference engine at `endpoint`; returns the seconds
        the slowest rank took."""
        return max(self._on_every_rank("push_reference", lambda t: t.push_reference.remote(endpoint, version)))

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on `batch` on every rank; returns rank 0's metrics."""
        return self._on_every_rank("step", lambda t: t.step.remote(batch))[0]

    def empty_cache(self) -> None:
        self._on_every_rank("empty_cache", lambda t: t.empty_cache.remote())

    def save_checkpoint(self, root: str, step: int) -> list[list[dict[str, Any]]]:
        """Every rank writes its files of step `step`'s checkpoint under `root`; their records, per rank in rank
        order."""
        return self._on_every_rank("save_checkpoint", lambda t: t.save_checkpoint.remote(root, step))

    def finish_checkpoint(self) -> list[list[dict[str, Any]]]:
        """Wait until the files of the save in flight (checkpoint.async_save) are written; their records, per rank
        in rank order (empty lists when no save is in flight)."""
        return self._on_every_rank("finish_checkpoint", lambda t: t.finish_checkpoint.remote())

    def load_checkpoint(self, path: str) -> None:
        self._on_every_rank("load_checkpoint", lambda t: t.load_checkpoint.remote(path))

    def export_hf(self, out_dir: str) -> str | None:
        """The model as an HF checkpoint in `out_dir`; returns the directory rank 0 wrote."""
        # rank 0 writes the whole model alone, after the others are done
        return self._on_every_rank("export_hf", lambda t: t.export_hf.remote(out_dir), lag_bound=False)[0]

    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return self._on_every_rank("pid", lambda t: t.pid.remote())

    def close(self, timeout: float | None = None) -> None:
        """Every rank closes its weight group and Megatron's process groups, given `timeout` seconds in all
        (default: the hang timeout); then the actors end."""
        _close(self.actors, lambda t: t.close.remote(), self.hang_timeout if timeout is None else timeout)


class Rollouts:
    """The rollout manager and the engine hosts, in engine order (with eval.bf16_reference the last host is
    the reference engine's). The manager writes `logs`/rollout-manager.log. A host that does not answer is
    waited for `unreachable_timeout` seconds (rollout.unreachable_timeout_s), also to stop its server."""

    def __init__(self, manager, hosts: list, logs: str, unreachable_timeout: float, stop: StopRequest | None = None):
        self.manager = manager
        self.hosts = hosts
        self.logs = logs
        self.unreachable_timeout = unreachable_timeout
        self.stop = stop  # its grace bounds every wait once a stop is requested
        self.urls: list[str] = []  # the engines' URLs from the last `endpoints()`: a failure names a node by them

    def _ask(self, method: str, call: Callable[[], Any]):
        """The result of `call()`, the manager's remote call of `method`; an engine's failure passes through as
        EngineFailure, any other error ends the run (RunFailure)."""
        ref = call()
        _first_ready([ref], None, self.stop)
        try:
            return ray.get(ref)
        except Exception as err:  # noqa: BLE001 - classified below
            if isinstance(getattr(err, "cause", None), EngineFailure):
                raise err.cause from None
            raise RunFailure(f"the rollout manager failed in {method}: {error_line(err)}; see "
                             f"{self.logs}/rollout-manager.log") from None

    def endpoints(self) -> list[tuple[str, str | None]]:
        """Every rollout engine's (URL, API key), in engine order."""
        endpoints = self._ask("endpoints", lambda: self.manager.endpoints.remote())
        self.urls = [url for url, _ in endpoints]
        return endpoints

    def reference_endpoint(self) -> tuple[str, str | None]:
        """(URL, API key) of the BF16 reference engine."""
        return self._ask("reference_endpoint", lambda: self.manager.reference_endpoint.remote())

    def quantized_linears(self) -> list[set[str]]:
        """HF module names of the linears each rollout engine quantized, in engine order."""
        return self._ask("quantized_linears", lambda: self.manager.quantized_linears.remote())

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The scored samples of `step` and the rollout's metrics."""
        return self._ask("generate", lambda: self.manager.generate.remote(step))

    def evaluate(self, step: int, *, reference: bool = False) -> dict[str, float]:
        """The eval/* metrics after `step` steps, of the rollout engines or (`reference`) the BF16 one."""
        return self._ask("evaluate", lambda: self.manager.evaluate.remote(step, reference=reference))

    def release_memory(self, *, reference: bool = False) -> None:
        """The rollout engines (or the reference engine) give back their GPU memory."""
        self._ask("release_memory", lambda: self.manager.release_memory.remote(reference=reference))

    def resume_memory(self, tags: list[str], *, reference: bool = False) -> None:
        """The rollout engines (or the reference engine) take back the memory of `tags` they released."""
        self._ask("resume_memory", lambda: self.manager.resume_memory.remote(tags, reference=reference))

    def pids(self) -> list[int]:
        """The engine servers' process ids, in engine order."""
        return self._ask("pids", lambda: self.manager.pids.remote())

    def restart(self, index: int) -> None:
        """Restart engine `index` (rollout.engines: the reference engine) on its node. While Ray cannot reach
        the node (the engine's host actor "unavailable": a link down, a node not yet declared dead) this
        waits, until the host answers or Ray declares it dead, at most `unreachable_timeout` seconds. An
        engine whose host actor died, with its node's Ray processes or the node itself, or that stays
        unreachable, cannot be restarted: RunFailure naming the engine and the node."""
        errors = ray.exceptions
        url = self.urls[index] if index < len(self.urls) else ""
        node = urlsplit(url).hostname or "?"
        deadline = time.monotonic() + self.unreachable_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunFailure(f"rollout engine {index}'s host on node {node} did not answer for "
                                 f"{self.unreachable_timeout:g} s (rollout.unreachable_timeout_s); check the node "
                                 "and its link, then resume")
            try:
                ray.get(self.hosts[index].pid.remote(), timeout=left)
                break
            except (errors.ActorUnavailableError, errors.GetTimeoutError):  # Ray has not decided yet: ask again
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            except errors.RayActorError as err:
                raise RunFailure(f"rollout engine {index} is gone with its host on node {node}: {error_line(err)}; "
                                 "bring the node back into the Ray cluster (launch/ray_cluster.sh worker) before "
                                 "resuming") from None
            except Exception:  # noqa: BLE001 - the host answered, with an error of its engine's: it is there
                break
        self._ask("restart", lambda: self.manager.restart.remote(index))

    def close(self, timeout: float | None = None) -> None:
        """Every host stops its engine server, given `timeout` seconds in all (default: the unreachable
        timeout); then the hosts and the manager end."""
        _close(self.hosts, lambda h: h.shutdown.remote(), self.unreachable_timeout if timeout is None else timeout)
        ray.kill(self.manager)
