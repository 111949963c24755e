"""The verl adapter against the real verl 0.9.1: its registry, its rollout-correction weights, its own losses'
normalisation, and its SGLang server's arguments (docs/integrations.md, "verl")."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import FSDPActorConfig, HFModelConfig, PolicyLossConfig, RolloutConfig

from qurl_mcore.integrations.verl import AGG_MODES, METHODS
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.rl.losses import policy_loss

from ..patching.copies import installed_copy

# verl's loss_agg_mode -> our aggregation of the same micro-batch reduction (verl's agg_loss in core_algos.py)
SAME_REDUCTION = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
                  "seq-mean-token-sum": "seq_mean_token_sum"}
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 3.0  # CAP: not policy_loss's default tis_cap, so the mapping shows


def actor_config(mode: str, method: str = "acr", **kw) -> FSDPActorConfig:
    """The actor config a verl run with docs/integrations.md's settings builds; rollout_correction is the dict
    Hydra makes of `++actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=...`."""
    return FSDPActorConfig(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, loss_agg_mode=mode, rollout_n=1,
                           ppo_micro_batch_size_per_gpu=2, **kw,
                           policy_loss=PolicyLossConfig(loss_mode=method,
                                                        rollout_correction={"rollout_is_threshold": CAP}))


def batch(rows: int = 6, cols: int = 9, mismatch: float = 0.8, empty_row: bool = True, seed: int = 0) -> dict:
    """Log-probs of π_prox (old), π_behav (rollout, off by ~`mismatch` nats: r spans both sides of every bound)
    and π_θ (a leaf), per-token advantages, and a response mask with ragged ends (and one empty row)."""
    g = torch.Generator().manual_seed(seed)
    f64 = {"generator": g, "dtype": torch.float64}
    old = -3 * torch.rand(rows, cols, **f64)
    mask = torch.arange(cols) < torch.randint(1, cols + 1, (rows, 1), generator=g)
    if empty_row:
        mask[1] = False
    return {"old": old, "rollout": old + mismatch * torch.randn(rows, cols, **f64),
            "log_prob": (old + 0.3 * torch.randn(rows, cols, **f64)).requires_grad_(),
            "advantages": torch.randn(rows, cols, **f64), "mask": mask}


def verl_weights(b: dict) -> torch.Tensor:
    """rollout_is_weights as verl's trainer computes them with rollout_is=token, rollout_is_threshold=inf."""
    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        b["old"], b["rollout"], b["mask"], rollout_is="token", rollout_is_threshold=math.inf)
    return weights.batch["rollout_is_weights"]


def verl_loss(method: str, b: dict, config, weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss verl's actor (verl/workers/utils/losses.py) gets from `method`, and its gradient."""
    lp = b["log_prob"].detach().clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn(method)(
        old_log_prob=b["old"], log_prob=lp, advantages=b["advantages"], response_mask=b["mask"],
        loss_agg_mode=config.loss_agg_mode, config=config,
        rollout_is_weights=verl_weights(b) if weights is None else weights)
    loss.backward()
    return loss.detach(), lp.grad


def ours(method: str, b: dict, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    lp = b["log_prob"].detach().clone().requires_grad_()
    loss, _ = policy_loss(lp, b["old"], b["rollout"], b["advantages"], b["mask"], method=method,
                          eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP, agg=agg)
    loss.backward()
    return loss.detach(), lp.grad


def take(b: dict, part: slice) -> dict:
    return {k: v[part] for k, v in b.items()}


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
@pytest.mark.parametrize("method", METHODS)
def test_registered_loss_is_policy_loss(method, mode):
    b = batch()
    loss, grad = verl_loss(method, b, actor_config(mode, method))
    expected, expected_grad = ours(method, b, SAME_REDUCTION[mode])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    # the inputs reach every branch: r beyond the cap, and ratios clipped at both ends
    _, metrics = policy_loss(b["log_prob"], b["old"], b["rollout"], b["advantages"], b["mask"], method=method,
                             eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP)
    assert metrics["is_ratio/truncated_frac"] > 0 and metrics["clip_frac/low"] > 0 and metrics["clip_frac/high"] > 0


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
def test_ranks_and_micro_batches_add_up_to_the_batch(mode):
    """verl normalises each micro-batch by its whole mini-batch (global_batch_info) and averages gradients over
    DP ranks: 2 ranks × 2 micro-batches of the adapter's loss make the mini-batch's `policy_loss`."""
    b = batch(rows=8, empty_row=False)  # verl counts every row of the mini-batch; ours only non-empty ones
    config = actor_config(mode)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=int(b["mask"].sum()), global_batch_size=8)
    parts = [verl_loss("acr", take(b, slice(i, i + 2)), config) for i in range(0, 8, 2)]
    expected, expected_grad = ours("acr", b, SAME_REDUCTION[mode])
    torch.testing.assert_close(sum(loss for loss, _ in parts) / 2, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.cat([grad for _, grad in parts]) / 2, expected_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
def test_normalisation_is_verls(mode):
    """Without mismatch ACR is PPO, so the adapter must return exactly what verl's own `vanilla` loss returns
    (dual clip off) for the same micro-batch and global_batch_info, an empty row included."""
    b = batch(mismatch=0.0)
    config = actor_config(mode, clip_ratio_c=1e9)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=3 * int(b["mask"].sum()), global_batch_size=20)
    loss, grad = verl_loss("acr", b, config)
    expected, expected_grad = verl_loss("vanilla", b, config, weights=torch.ones_like(b["old"]))
    torch.testing.assert_close(loss, expected, rtol=1e-7, atol=0)  # verl's seq-mean-token-mean adds 1e-8
    torch.testing.assert_close(grad, expected_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum-norm"])
def test_unsupported_aggregation_raises(mode):
    assert set(AGG_MODES) == set(SAME_REDUCTION)  # supported: the modes with a counterpart, no other
    with pytest.raises(ValueError, match=f"loss_agg_mode '{mode}' is not supported.*token-mean"):
        verl_loss("acr", batch(), actor_config(mode))


def test_missing_or_truncating_rollout_weights_raise():
    b, config = batch(), actor_config("token-mean")
    fn = core_algos.get_policy_loss_fn("acr")
    args = {"old_log_prob": b["old"], "log_prob": b["log_prob"], "advantages": b["advantages"],
            "response_mask": b["mask"], "loss_agg_mode": "token-mean", "config": config}
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is=token"):
        fn(**args, rollout_is_weights=None)
    icepop, _, _ = compute_rollout_correction_and_rejection_mask(  # zero weights outside [0.5, 2]
        b["old"], b["rollout"], b["mask"], rollout_is="token", rollout_is_threshold="0.5_2.0")
    with pytest.raises(ValueError, match="rollout_is_threshold=inf"):
        fn(**args, rollout_is_weights=icepop.batch["rollout_is_weights"])


def test_empty_micro_batch_contributes_nothing():
    b = batch()
    b["mask"][:] = False
    loss, grad = verl_loss("acr", b, actor_config("token-mean"), weights=torch.zeros_like(b["old"]))
    assert loss.item() == 0 and not grad.any()


@pytest.fixture(scope="module")
def tiny_llama() -> str:
    return str(tiny_checkpoint("llama"))


def test_external_lib_registers_the_losses(monkeypatch, tiny_llama):
    """`actor_rollout_ref.model.external_lib` is imported by verl's HFModelConfig, which the actor worker builds
    before its loss (verl/workers/engine_workers.py:540, verl/workers/config/model.py:149)."""
    for method in METHODS:
        monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, method)
    monkeypatch.delitem(sys.modules, "qurl_mcore.integrations.verl")
    HFModelConfig(path=tiny_llama, external_lib="qurl_mcore.integrations.verl")
    assert set(METHODS) <= set(core_algos.POLICY_LOSS_REGISTRY)


ROLLOUT = "verl.workers.rollout.sglang_rollout."
PATCHED = ("http_server_engine", "sglang_rollout", "async_sglang_server")  # each imports the one before


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> SimpleNamespace:
    """verl's SGLang rollout modules as `qurl patch apply --target verl` leaves them (patches/verl/0.9.1), from a
    patched copy of the installed files, in sys.modules for this module's tests; the venv's verl stays as
    published."""
    ps = installed_copy("verl", tmp_path_factory.mktemp("site"))
    assert ps.apply() == sorted(ps.patches)
    files = {(ROLLOUT + name).replace(".", "/") + ".py": name for name in PATCHED}
    assert set(files) == {fp.path for file_patches in ps.patches.values() for fp in file_patches}
    modules = {}
    with pytest.MonkeyPatch.context() as mp:
        for path, name in files.items():
            spec = importlib.util.spec_from_file_location(ROLLOUT + name, ps.root / path)
            modules[name] = importlib.util.module_from_spec(spec)
            mp.setitem(sys.modules, ROLLOUT + name, modules[name])
            spec.loader.exec_module(modules[name])
        yield SimpleNamespace(**modules)


def cpu_server_env(monkeypatch) -> None:
    """What verl's server needs on this CPU machine: SGLang's CPU engine, and the visible-devices variable the
    server sets for its process restored after the test."""
    from verl.utils.device import get_visible_devices_keyword

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    devices = get_visible_devices_keyword()
    monkeypatch.setenv(devices, os.environ.get(devices, ""))


def sglang_server(patched_verl, rollout: RolloutConfig, model: HFModelConfig):
    from verl.workers.rollout.replica import RolloutMode

    return patched_verl.async_sglang_server.SGLangHttpServer(
        rollout, model, RolloutMode.HYBRID, workers=[], replica_rank=0, node_rank=0, nnodes=1, cuda_visible_devices="",
        base_gpu_id=0)


def test_rollout_engine_kwargs_reach_sglang_server_args(monkeypatch, tiny_llama, patched_verl):
    """Patched, verl's SGLangHttpServer.launch_server gets past line 375 (dataclasses.fields of SGLang 0.5.23's
    msgspec ServerArgs), loads SGLang's plugins as SGLang's Engine does, and makes the ServerArgs its engine
    starts with: verl's keys, then `engine_kwargs.sglang`. The test stops it where the engine processes would
    start (Engine._launch_subprocesses) and resolves those arguments as that call does first."""
    from sglang.srt import plugins
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.http_server import Engine
    from sglang.srt.layers import quantization

    from qurl_mcore.sglang.config import CONFIGS
    from qurl_mcore.sglang.options import QurlOptions

    cpu_server_env(monkeypatch)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)  # a fresh server process: nothing loaded yet
    for method in CONFIGS:
        monkeypatch.delitem(quantization.QUANTIZATION_METHODS, method, raising=False)

    class Launch(Exception):
        """Raised with the ServerArgs where verl would start the engine's processes."""

    def launch(server_args, **_):
        raise Launch(server_args)

    monkeypatch.setattr(Engine, "_launch_subprocesses", staticmethod(launch))
    override = QurlOptions.parse("qurl_int8", {"scope": "all"}).override_args()
    sglang_kwargs = {"quantization": "qurl_int8", "json_model_override_args": json.dumps(override),
                     "device": "cpu", "attention_backend": "torch_native"}  # the last two: this CPU machine
    rollout = RolloutConfig(name="sglang", tensor_model_parallel_size=1, engine_kwargs={"sglang": sglang_kwargs})
    server = sglang_server(patched_verl, rollout, HFModelConfig(path=tiny_llama))
    with pytest.raises(Launch) as launched:
        asyncio.run(server.launch_server())
    server_args = launched.value.args[0]
    assert {k: getattr(server_args, k) for k in sglang_kwargs} == sglang_kwargs
    assert server_args.enable_weights_cpu_backup  # line 375's branch ran: HYBRID mode sets it, SGLang's default is off
    assert quantization.QUANTIZATION_METHODS["qurl_int8"] is CONFIGS["qurl_int8"]  # verl loaded our plugin

    server_args.resolve_once()  # what Engine._launch_subprocesses does first
    model = ModelConfig.from_server_args(server_args)
    assert (server_args.quantization, model.quantization) == ("qurl_int8", "qurl_int8")
    assert model.hf_config.quantization_config == override["quantization_config"]
    assert quantization.get_quantization_config(model.quantization) is CONFIGS["qurl_int8"]
