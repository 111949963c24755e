"""Ray placement of the loop's actors: the trainer group (one actor per Megatron rank), one `EngineHost` per
SGLang engine, and the `RolloutManager`.

The bundles and who goes where are `qurl_mcore.placement`'s.
"""
from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from qurl_mcore.config import Config, ConfigError
from qurl_mcore.placement import Placement, placement_of, unplaceable
from qurl_mcore.recipe import te_fp8_available
from qurl_mcore.transfer import free_port

from .groups import Rollouts, TrainerGroup
from .outcome import RunFailure
from .sampler import EngineHost, RolloutManager, engine_config, reference_engine_config


def _options(placement: Placement, pg, index: int, devices: float, threads: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}
    if placement.device == "GPU":
        opts.update(num_gpus=devices, num_cpus=0)
    else:
        # Ray would pin OMP_NUM_THREADS to the fractional CPU count (1); phases alternate, so each may use all
        opts.update(num_cpus=devices, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
    return opts


def endpoint_host(nodes: int) -> str | None:
    """Where the run's endpoints listen (the trainer's rendezvous and weight group, the engines' servers) in a
    Ray cluster of `nodes` nodes: loopback on a single node, where nothing outside the machine needs to reach
    them; None otherwise, for the address of the node each endpoint runs on, which the other nodes reach."""
    return "127.0.0.1" if nodes == 1 else None


def _rendezvous(host: str | None) -> tuple[str, int]:
    """`host` (None: this node's address) and a TCP port free there."""
    addr = host or ray.util.get_node_ip_address()
    return addr, free_port(addr)


def wait_for_placement(pg, stop, timeout: float = 600.0) -> None:
    """Wait for placement group `pg` (resources that exist but are busy), giving up on `stop.requested` (a
    signal) or after `timeout` seconds, with the group removed either way."""
    ready = pg.ready()
    deadline = time.monotonic() + timeout
    while not ray.wait([ready], timeout=1.0)[0]:
        if (stop is not None and stop.requested) or time.monotonic() > deadline:
            remove_placement_group(pg)
            why = f"{stop.signal_name} received" if stop is not None and stop.requested else f"{timeout:.0f} s passed"
            raise RunFailure(f"the Ray cluster did not place the run's bundles ({why}); other jobs may hold "
                               "the resources: see `ray status`")


def start_actors(cfg: Config, model_path: str, stop=None) -> tuple[TrainerGroup, Rollouts, Any]:
    """Create the placement group, the trainer ranks, the engine hosts and the rollout manager.
    Returns their typed groups (groups.py) and the placement group; with eval.bf16_reference the last host
    is the BF16 reference engine's, which only evaluations use, in engine 0's bundle with half its share
    (trainer rank 0 there pushes to it by shared memory / CUDA IPC, as to engine 0). Engines start in
    parallel with the trainers, except with rollout.offload: then they start first, size their KV cache on
    GPUs no trainer has touched yet, and give their memory back before the trainers start (the first push
    takes it again).
    A placement the cluster cannot hold is refused at once (ValueError naming what is missing); one it can
    hold but not yet is waited for, as long as `stop` (an outcome.StopRequest) is not requested."""
    # here, not at the top: trainer.py imports Megatron-Core, which the driver process need not load
    from .trainer import PolicyTrainer

    resources = ray.cluster_resources()
    use_gpu = resources.get("GPU", 0) > 0
    placement = placement_of(cfg, use_gpu, {t for t in ("qurl_train", "qurl_rollout") if t in resources})
    problem = unplaceable(placement, resources, "the Ray cluster")
    if problem:
        raise ConfigError(problem)
    pg = placement_group(placement.bundles, strategy="PACK")
    wait_for_placement(pg, stop)
    threads = cfg.train.threads or os.cpu_count() or 1
    world = len(placement.trainer)
    engine_devices = placement.share * (cfg.rollout.tp_size if use_gpu and cfg.layout == "disaggregated" else 1)
    # resolved once, here, for every trainer rank and every engine (qurl_mcore/recipe.py)
    recipe = cfg.recipe(te_available=te_fp8_available(cuda=use_gpu))
    config = engine_config(cfg, recipe.engine, model_path, "cuda" if use_gpu else "cpu")
    nodes = sum(node["Alive"] for node in ray.nodes())
    # colocated engines only hear their own node's trainer; disaggregated ones, the trainer's node
    host = "127.0.0.1" if cfg.layout == "colocated" else endpoint_host(nodes)
    logs = os.path.abspath(cfg.logging.dir)  # each actor's output: a file of its own there
    configs = [(config, b, engine_devices) for b in placement.engines]
    if cfg.eval.every and cfg.eval.bf16_reference:  # preflight: colocated only
        configs[0] = (config, placement.engines[0], engine_devices / 2)
        configs.append((reference_engine_config(cfg, model_path, config.device), *configs[0][1:]))
    hosts = [ray.remote(EngineHost).options(**_options(placement, pg, b, devices, threads)).remote(
        c, host, log_file=f"{logs}/engine-{i}.log") for i, (c, b, devices) in enumerate(configs)]
    if cfg.offload_rollout(use_gpu):
        for i, h in enumerate(hosts):
            try:
                ray.get(h.release_memory.remote())
            except Exception as err:  # noqa: BLE001 - any failure to start or release: name the engine
                for actor in hosts:
                    ray.kill(actor)
                remove_placement_group(pg)
                raise RunFailure(f"rollout engine {i} failed to start: {str(err)[-500:]}; see "
                                 f"{logs}/engine-{i}.log") from None
    # rank 0 hosts the rendezvous: its node's address, and a port free there (not on the driver's node)
    master, port = ray.get(ray.remote(_rendezvous).options(
        **_options(placement, pg, placement.trainer[0], 0, threads)).remote(endpoint_host(nodes)))
    trainers = [ray.remote(PolicyTrainer).options(**_options(placement, pg, b, placement.share, threads)).remote(
        cfg, recipe, rank, world, master, port, log_file=f"{logs}/trainer-{rank}.log")
        for rank, b in enumerate(placement.trainer)]
    engines = cfg.rollout.engines
    # on the driver's node: an engine node that goes down must not take the manager (the driver's view of the
    # engines) with it, or the failure is reported as the manager's
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    manager = ray.remote(RolloutManager).options(num_cpus=0, scheduling_strategy=here).remote(
        cfg, model_path, hosts[:engines], log_file=f"{logs}/rollout-manager.log",
        reference=hosts[engines] if len(hosts) > engines else None)
    return (TrainerGroup(trainers, cfg.logging.dir, cfg.train.hang_timeout_s, stop),
            Rollouts(manager, hosts, cfg.logging.dir, cfg.rollout.unreachable_timeout_s, stop), pg)
