"""Loop pieces without engines: prompt order, advantages and dynamic sampling, actor placement, the engine
configuration of each rollout precision, and the config checks the loop relies on."""
from __future__ import annotations

import random
import time

import pytest
import torch

from qurl_mcore.config import ConfigError, load_config
from qurl_mcore.placement import placement_of
from qurl_mcore.loop.batch import Sample
from qurl_mcore.loop.driver import advantages
from qurl_mcore.loop.sampler import (EngineFailure, engine_config, engine_quantization, epoch_order,
                                     prompt_indices)
from qurl_mcore.preflight import preflight


def test_prompt_order_is_a_permutation_per_epoch_and_a_function_of_the_step():
    n, per_step = 10, 4
    stream = [i for step in range(5) for i in prompt_indices(n, step, per_step, seed=3)]  # 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # each epoch reshuffled
    assert prompt_indices(n, 3, per_step, seed=3) == stream[12:16]  # resuming at step 3 takes the same prompts
    assert prompt_indices(n, 0, per_step, seed=4) != prompt_indices(n, 0, per_step, seed=3)


def test_prompt_order_makes_one_permutation_per_epoch_whatever_the_prompt_set_size():
    """A step costs one permutation of the prompt set per epoch it touches, not one per prompt position: 256
    prompts of 100k take one shuffle (256 took tens of seconds), and the prompts are those of the definition."""
    epoch_order.cache_clear()
    n, per_step = 100_000, 256
    start = time.perf_counter()
    first = [prompt_indices(n, step, per_step, seed=1) for step in range(3)]
    assert epoch_order.cache_info().misses == 1
    assert time.perf_counter() - start < 5.0
    order = list(range(n))
    random.Random("1-0").shuffle(order)  # the definition: epoch 0's permutation seeded by (seed, epoch)
    assert [i for step in first for i in step] == order[:3 * per_step]
    epoch_order.cache_clear()
    prompt_indices(10, 2, 4, seed=1)  # positions 8..11 span epochs 0 and 1
    assert epoch_order.cache_info().misses == 2


def _samples(rewards: list[float]) -> list[Sample]:
    return [Sample([1], [2], [-0.5], reward=r, group=i // 2) for i, r in enumerate(rewards)]


def test_advantages_grpo_and_dynamic_sampling():
    cfg = load_config(None, ["rollout.samples_per_prompt=2", "train.advantage=grpo"])
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    kept, adv, metrics = advantages(cfg, _samples(rewards))
    assert len(kept) == 6 and metrics["rollout/groups_with_signal"] == pytest.approx(2 / 3)
    # n = 2, Bessel std of {1, 0} is 1/sqrt(2): A = ±0.5·sqrt(2)
    assert torch.allclose(adv, torch.tensor([1, -1, 0, 0, -1, 1]) * 2 ** -0.5, atol=1e-5)
    cfg = load_config(None, ["rollout.samples_per_prompt=2", "train.dynamic_sampling=true"])
    kept, adv, _ = advantages(cfg, _samples(rewards))
    assert [s.reward for s in kept] == [1.0, 0.0, 0.0, 1.0] and adv.shape == (4,)
    kept, adv, _ = advantages(cfg, _samples([1.0, 1.0]))
    assert kept == [] and adv.numel() == 0


def test_advantages_rloo():
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "train.advantage=rloo"])
    _, adv, _ = advantages(cfg, _samples([1.0, 0.0, 0.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5]))


def test_placement_colocated_shares_trainer_bundles():
    cfg = load_config(None, ["train.tp_size=2", "train.dp_size=2", "rollout.engines=4"])
    p = placement_of(cfg, use_gpu=True, tags={"qurl_train", "qurl_rollout"})
    assert len(p.bundles) == 4 and p.trainer == [0, 1, 2, 3] and p.engines == [0, 1, 2, 3] and p.share == 0.5
    assert p.bundles[0] == {"GPU": 1.0, "CPU": 1.0, "qurl_train": 0.001, "qurl_rollout": 0.001}
    cpu = placement_of(load_config(None), use_gpu=False)
    assert cpu.bundles == [{"CPU": 1.0}] and cpu.device == "CPU"


def test_placement_disaggregated_gives_engines_their_own_devices():
    cfg = load_config(None, ["layout=disaggregated", "train.tp_size=8", "rollout.engines=2", "rollout.tp_size=4"])
    p = placement_of(cfg, use_gpu=True, tags={"qurl_train", "qurl_rollout"})
    assert p.trainer == list(range(8)) and p.engines == [8, 9] and p.share == 1.0
    assert p.bundles[8] == {"GPU": 4.0, "CPU": 1.0, "qurl_rollout": 0.001}
    assert "qurl_rollout" not in p.bundles[0]


def test_placement_errors_name_the_fix():
    with pytest.raises(ValueError, match="rollout.tp_size must be 1"):
        placement_of(load_config(None, ["rollout.tp_size=2"]), use_gpu=True)
    with pytest.raises(ValueError, match="exceeds the 1 trainer"):
        placement_of(load_config(None, ["rollout.engines=2"]), use_gpu=False)


@pytest.mark.parametrize("precision,method,options", [
    ("bf16", None, {}),
    ("int8", "qurl_int8", {"fmt": "int8", "scope": "all"}),
    ("fp8", "qurl_fp8", {"fmt": "fp8_e4m3", "scope": "all"}),
    ("fp8_e2e", "qurl_fp8", {"fmt": "fp8_e4m3", "scope": "all"}),
    ("fp4", "qurl_fp4", {"fmt": "nvfp4", "scope": "experts"}),
    ("fp4_rc", "qurl_fp4_rc", {"fmt": "mxfp4", "scope": "experts"}),
    ("fp4_rc", "qurl_fp4_rc", {"fmt": "hif4", "scope": "experts"}),
    ("fp4_rc_rollout", "qurl_fp4_rc", {"fmt": "nvfp4", "scope": "all"}),
    ("fp4_rc_train", "qurl_fp4", {"fmt": "nvfp4", "scope": "experts"}),
])
def test_engine_quantization_per_precision(precision, method, options):
    over = [f"precision={precision}", "uaq.enabled=false"]
    if "fmt" in options and options["fmt"] in ("nvfp4", "mxfp4", "hif4"):
        over.append(f"fp4_format={options['fmt']}")
    if precision == "fp4_rc_rollout":
        over.append("scope=all")
    cfg = load_config(None, over)
    recipe = cfg.recipe()
    expected = {**options, "requant": "eager", "push": "bf16"} if method else {}
    assert engine_quantization(recipe.engine, "eager") == (method, expected)
    from qurl_mcore.models.tiny import tiny_checkpoint

    config = engine_config(cfg, recipe.engine, str(tiny_checkpoint("qwen3")), "cpu")
    options = config.options()
    # what an engine process rebuilds from the method and options it is started with is the driver's half
    assert (options.recipe if options else None) == recipe.engine
    assert config.quantization == method and config.device == "cpu"
    assert not config.return_routed_experts  # a dense model routes nothing
    for moe in ("qwen3_moe", "mixtral"):
        assert engine_config(cfg, recipe.engine, str(tiny_checkpoint(moe)), "cpu").return_routed_experts


def test_rollout_requant_reaches_the_engines_options():
    """`rollout.requant` names one of the plugin's quantizers (the config's choices are REQUANTS' keys)."""
    from typing import get_args, get_type_hints

    from qurl_mcore.config import RolloutConfig
    from qurl_mcore.sglang.options import REQUANTS

    assert get_args(get_type_hints(RolloutConfig)["requant"]) == tuple(REQUANTS)
    cfg = load_config(None, ["precision=fp8", "rollout.requant=compiled"])
    from qurl_mcore.models.tiny import tiny_checkpoint

    engine = cfg.recipe().engine
    assert engine_config(cfg, engine, str(tiny_checkpoint("qwen3")), "cpu").options().requant == "compiled"
    with pytest.raises(ValueError, match="rollout.requant"):
        load_config(None, ["rollout.requant=jit"])


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as the kernel writes them) of the sockets listening on TCP `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_a_single_node_run_listens_on_loopback_only():
    """On one node the trainer's rendezvous (and with it the weight group and the engines) is loopback, and
    the store rank 0 hosts there listens on nothing else (the kernel's table says so); across nodes each
    endpoint takes its node's address."""
    import importlib
    from datetime import timedelta

    from qurl_mcore.loop.actors import _rendezvous, endpoint_host
    from qurl_mcore.transfer import bind_stores_to_their_address

    assert endpoint_host(1) == "127.0.0.1" and endpoint_host(2) is None
    addr, port = _rendezvous(endpoint_host(1))
    assert addr == "127.0.0.1"
    bind_stores_to_their_address()
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    store = rendezvous._create_c10d_store(addr, port, 0, 1, timedelta(seconds=30))
    store.set("k", "v")
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, little-endian; not 00000000 (every interface)
    del store


def test_engine_failure_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(EngineFailure(2, "ConnectionError: refused")))
    assert err.index == 2 and "engine 2 failed: ConnectionError" in str(err)


def test_loop_config_checks():
    cfg = load_config(None, ["train.ep_size=3", "train.tp_size=2", "train.entropy_coef=0.1"])
    text = preflight(cfg).report()
    assert "train.ep_size: 3 must divide" in text and "entropy" in text
    with pytest.raises(ConfigError, match="rollout.top_k: must be -1"):
        load_config(None, ["rollout.top_k=0"])


@pytest.mark.parametrize("name", ["cpu_demo", "gsm8k_ppo_qwen2.5_0.5b_int8", "dapo_qwen2.5_7b_math_int8",
                                  "deepscaler_grpo_1.5b_int8", "grpo_32b_int8", "grpo_qwen3_30b_a3b_fp4_rc"])
def test_shipped_configs_load_and_place(name, tmp_path):
    from pathlib import Path

    path = Path(__file__).parents[2] / "launch" / "configs" / f"{name}.yaml"
    prompts = tmp_path / "prompts.jsonl"
    # every key a shipped config reads: the plain ones and verl's layout (DAPO-Math-17K's reward_model.ground_truth)
    prompts.write_text('{"question": "1+1", "prompt": "1+1", "problem": "1+1", "answer": "2", '
                       '"reward_model": {"ground_truth": "2", "style": "rule"}}\n')
    cfg = load_config(path, [] if name == "cpu_demo" else [f"data.path={prompts}"])
    gpu = name != "cpu_demo"
    p = placement_of(cfg, use_gpu=gpu, tags={"qurl_train", "qurl_rollout"})
    assert len(p.trainer) == cfg.train.tp_size * cfg.train.dp_size
    assert len(p.engines) == cfg.rollout.engines
    problems = preflight(cfg, use_gpu=gpu).problems
    # the GPU configs name checkpoints on the cluster: their absence here is the one problem allowed
    assert all(p.startswith("model.path:") for p in problems) and (gpu or not problems), problems
